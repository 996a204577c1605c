"""kernels/adamw.py: the bf16 + remainder encoding of an fp32 master is exact, rounds like bf16 (ties aside), and the
Triton update (interpreted on CPU) equals the torch reference for fp32 and bf16-remainder masters."""

from __future__ import annotations

import pytest
import torch

from moe_launch.kernels.adamw import AdamWScalars, adamw_fused_, adamw_reference_, join_master, split_master

torch.set_num_threads(1)


def _masters(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-20, 20, n)[torch.randperm(n, generator=g)]
    return torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-40, -1e-40])])


def test_split_join_is_exact_and_rounds_to_nearest():
    m = _masters(4000, 0)
    hi, rem = split_master(m)
    assert hi.dtype == torch.bfloat16 and rem.dtype == torch.int16
    assert torch.equal(join_master(hi, rem).view(torch.int32), m.view(torch.int32))  # bit-exact, signs and zeros too
    low = m.view(torch.int32) & 0xFFFF
    not_tie = low != 0x8000
    assert torch.equal(hi[not_tie], m[not_tie].to(torch.bfloat16))  # away from ties: round to nearest, as .to()


def test_ties_round_away_from_zero():
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1.0078125 (RNE would give 1.0)
    m = torch.tensor([1.0 + 2**-8, -(1.0 + 2**-8)])
    hi, rem = split_master(m)
    assert hi.tolist() == [1.0078125, -1.0078125]
    assert torch.equal(join_master(hi, rem), m)


def _state(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.01,
            torch.rand(n, generator=g) * 1e-3, torch.randn(n, generator=g))


@pytest.mark.parametrize("n", [1, 2047, 5000])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_reference_fp32_master(n, grad_dtype):
    p, m, v, g = _state(n, n)
    ref = [t.clone() for t in (p, m, v)]
    for step in (1, 2, 3):
        s = AdamWScalars(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step, grad_scale=0.37)
        gg = (g * step).to(grad_dtype)
        adamw_fused_(p, None, m, v, gg, s)
        adamw_reference_(ref[0], ref[1], ref[2], gg, s)
    for got, want in zip((p, m, v), ref):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-8)  # atol: ulps of lr-sized terms


@pytest.mark.parametrize("n", [3, 4099])
def test_fused_bf16_remainder_equals_reference_on_an_fp32_master(n):
    p, m, v, g = _state(n, 100 + n)
    master = p.clone()  # the fp32 master a separate copy would hold
    param, rem = split_master(p)
    ref_m, ref_v = m.clone(), v.clone()
    for step in (1, 2, 3, 4):
        s = AdamWScalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        gg = (g / step).to(torch.bfloat16)
        adamw_fused_(param, rem, m, v, gg, s)
        adamw_reference_(master, ref_m, ref_v, gg, s)
    torch.testing.assert_close(join_master(param, rem), master, rtol=2e-6, atol=1e-8)
    # the parameter is the master's rounding
    decoded = join_master(param, rem)
    not_tie = (decoded.view(torch.int32) & 0xFFFF) != 0x8000
    assert torch.equal(param[not_tie], decoded[not_tie].to(torch.bfloat16))
    torch.testing.assert_close(m, ref_m, rtol=2e-6, atol=1e-9)
    torch.testing.assert_close(v, ref_v, rtol=2e-6, atol=1e-12)


def test_reference_through_the_remainder_is_bitwise_an_fp32_master():
    # decode -> update -> encode loses nothing: many tiny steps on bf16 parameters track an fp32 master exactly
    p, m, v, g = _state(257, 7)
    master, param, rem = p.clone(), *split_master(p)
    m2, v2 = m.clone(), v.clone()
    for step in range(1, 21):
        s = AdamWScalars(lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        adamw_reference_(master, m, v, g, s)
        decoded = join_master(param, rem)
        adamw_reference_(decoded, m2, v2, g, s)
        param, rem = split_master(decoded)
    assert torch.equal(join_master(param, rem), master)
    assert not torch.equal(param.float(), p.to(torch.bfloat16).float())  # 1e-5 steps moved some bf16 values


def test_fused_rejects_bad_inputs():
    p, m, v, g = _state(8, 1)
    s = AdamWScalars(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="remainder"):
        adamw_fused_(p.to(torch.bfloat16), None, m, v, g, s)
    with pytest.raises(ValueError, match="equal length"):
        adamw_fused_(p, None, m[:4], v, g, s)
