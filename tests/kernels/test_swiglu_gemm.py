"""The fused SwiGLU grouped GEMMs (kernels/swiglu_gemm.py) against the unfused stages they replace, under Triton's
interpreter: random uneven routing with empty experts and NaN rows past the last expert's, both layouts of b, a tile
walk with and without row grouping; the operands they refuse; the bf16 layer on them; the path choice. On an sm90
GPU, gpu_grouped_gemm_tma.py runs them compiled."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import random_idx, rel_err

from moe_launch.kernels import moe
from moe_launch.kernels import swiglu_gemm as sg
from moe_launch.kernels.grouped_gemm import grouped_mm_reference
from moe_launch.kernels.grouped_gemm_tma import Tiles
from moe_launch.kernels.moe import fast_experts
from moe_launch.kernels.swiglu import swiglu_fwd_triton

TILES = [Tiles(16, 16, 16, 4, 2), Tiles(32, 16, 16, 4, 2, group_m=3)]


def _routed(gen: torch.Generator, E: int = 6, pad: int = 11):
    counts = torch.randint(0, 40, (E,), generator=gen)
    counts[torch.randint(0, E, (2,), generator=gen)] = 0  # experts with no rows
    counts_E = counts.to(torch.int32)
    offsets_E1 = torch.zeros(E + 1, dtype=torch.int32)
    offsets_E1[1:] = torch.cumsum(counts_E, 0)
    return counts_E, offsets_E1, int(offsets_E1[-1]), pad


def _rows(gen, R: int, pad: int, K: int) -> torch.Tensor:
    a = torch.randn(R + pad, K, generator=gen).bfloat16()
    a[R:] = float("nan")  # rows past R: never read into a valid row
    return a


def _weights(gen, E: int, K: int, M: int, kmajor: bool) -> torch.Tensor:
    """b [E, K, M], stored K-major (as w_EMK.transpose(1, 2)) or M-major."""
    if kmajor:
        return (0.2 * torch.randn(E, M, K, generator=gen)).bfloat16().transpose(1, 2)
    return (0.2 * torch.randn(E, K, M, generator=gen)).bfloat16()


def _mm(a, b, counts_E, offsets_E1, R):
    return grouped_mm_reference(a[:R].float(), b.float(), counts_E, offsets_E1)


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t.BM}x{t.BN}x{t.BK}g{t.group_m}")
@pytest.mark.parametrize("kmajor", [True, False], ids=["b K-major", "b M-major"])
def test_swiglu_up_is_both_projections_and_swiglu(tiles, kmajor):
    gen = torch.Generator().manual_seed(hash((tiles, kmajor, "up")) % 2**31)
    counts_E, offsets_E1, R, pad = _routed(gen)
    D, F = 48, 40
    x = _rows(gen, R, pad, D)
    bg, bu = _weights(gen, 6, D, F, kmajor), _weights(gen, 6, D, F, kmajor)
    g, u, h = sg.swiglu_up(x, bg, bu, counts_E, offsets_E1, tiles=tiles)
    g_ref, u_ref = _mm(x, bg, counts_E, offsets_E1, R), _mm(x, bu, counts_E, offsets_E1, R)
    assert rel_err(g[:R], g_ref) < 1e-2 and rel_err(u[:R], u_ref) < 1e-2  # bf16 output rounding
    # the unfused SwiGLU kernel on the rounded g and u, bit for bit
    assert torch.equal(h[:R], swiglu_fwd_triton(g, u, torch.tensor([R], dtype=torch.int32))[:R])


@pytest.mark.parametrize("kmajor", [True, False], ids=["b K-major", "b M-major"])
def test_dual_mm_is_the_sum_of_both_products(kmajor):
    gen = torch.Generator().manual_seed(17 + kmajor)
    counts_E, offsets_E1, R, pad = _routed(gen)
    K, M = 40, 48
    a1, a2 = _rows(gen, R, pad, K), _rows(gen, R, pad, K)
    b1, b2 = _weights(gen, 6, K, M, kmajor), _weights(gen, 6, K, M, kmajor)
    c = sg.dual_mm(a1, b1, a2, b2, counts_E, offsets_E1, tiles=TILES[1])
    ref = _mm(a1, b1, counts_E, offsets_E1, R) + _mm(a2, b2, counts_E, offsets_E1, R)
    assert rel_err(c[:R], ref) < 1e-2


def test_operands_it_cannot_fuse_are_refused():
    counts_E, offsets_E1 = torch.tensor([4, 4], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    x = torch.randn(8, 32).bfloat16()
    b_k = torch.randn(2, 16, 32).bfloat16().transpose(1, 2)
    b_m = torch.randn(2, 32, 16).bfloat16()
    assert sg.fusable(x, b_k, b_k) and not sg.fusable(x, b_k, b_m)  # the two weights laid out differently
    assert not sg.fusable(x.float(), b_k.float())  # fp32: the unfused kernels
    with pytest.raises(ValueError, match="laid out alike"):
        sg.swiglu_up(x, b_k, b_m, counts_E, offsets_E1)
    with pytest.raises(ValueError, match="one shape"):
        sg.dual_mm(torch.randn(8, 16).bfloat16(), b_m.transpose(1, 2).contiguous(), torch.randn(6, 16).bfloat16(),
                   b_m.transpose(1, 2).contiguous(), counts_E, offsets_E1)


def test_the_bf16_layer_on_the_fused_kernels_matches_the_unfused_one(monkeypatch):
    calls = {name: 0 for name in ("swiglu_up", "dual_mm")}
    for name in calls:
        fn = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _fn=fn, _name=name, **k: calls.__setitem__(_name, calls[_name] + 1)
                            or _fn(*a, **k))
    gen = torch.Generator().manual_seed(23)
    T, D, F, E, K = 40, 32, 48, 8, 2
    x = torch.randn(T, D, generator=gen).bfloat16().requires_grad_()
    idx = random_idx(T, K, E, gen, skip=range(3, 4))
    w = torch.rand(T, K, generator=gen).bfloat16().requires_grad_()
    ws = [(0.1 * torch.randn(E, a, b, generator=gen)).bfloat16().requires_grad_() for a, b in ((F, D), (F, D), (D, F))]
    dy = torch.randn(T, D, generator=gen).bfloat16()
    outs = []
    for impl in ("tma", "triton"):
        for t in (x, w, *ws):
            t.grad = None
        y = fast_experts(x, idx, w, *ws, gemm_impl=impl)
        y.backward(dy)
        outs.append([y.detach()] + [t.grad for t in (x, w, *ws)])
    assert calls == {"swiglu_up": 1, "dual_mm": 1}  # the tma run took both fused kernels
    for got, ref in zip(*outs):
        assert rel_err(got, ref) < 1e-2  # bf16 roundings at different points (dx rounded once, not twice)


def test_the_path_choice():
    """Fused where the layer won (512 rows per expert or more, dims up to 2048); unfused at gpt-oss-20b's and
    Mixtral's dims, with fewer rows than measured, for fp32, and for any gemm_impl but auto and tma."""
    olmoe_16k, olmoe_4k = 16384 * 8, 4096 * 8
    assert sg.choose(olmoe_16k, 2048, 1024, 64) and sg.choose(olmoe_4k, 2048, 1024, 64)
    assert sg.choose(16384 * 6, 2048, 1408, 64)  # DeepSeek-V2-Lite
    assert not sg.choose(16384 * 4, 2880, 2880, 32)  # gpt-oss-20b
    assert not sg.choose(8192 * 2, 4096, 14336, 8)  # Mixtral-8x7B-like
    assert not sg.choose(1024 * 8, 2048, 1024, 64)  # 128 rows per expert
    x = torch.randn(64, 32).bfloat16()
    w = torch.randn(4, 16, 32).bfloat16()
    assert sg.fused_path("tma", x, w, w)  # the CPU under the interpreter: where asked
    assert not sg.fused_path("auto", x, w, w)  # no CUTLASS path to compare with
    assert not sg.fused_path("torch", x, w, w) and not sg.fused_path("triton", x, w, w)
    assert not sg.fused_path("tma", x.float(), w.float(), w.float())
