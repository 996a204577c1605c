"""The persistent TMA grouped GEMM (kernels/grouped_gemm_tma.py) against its references, under Triton's interpreter:
random uneven routing with empty experts, both layouts of b, every tile walk, e4m3 with row and column scales; its
place in the layer (gemm_impl="tma") and the shape choice. On an sm90 GPU, gpu_grouped_gemm_tma.py runs the
compiled kernel."""

from __future__ import annotations

import pytest
import torch
from helpers_gpu import host_has_gpu
from kernel_helpers import random_idx, rel_err, run_compiled

from moe_launch.kernels import fp8
from moe_launch.kernels import grouped_gemm_tma as tma
from moe_launch.kernels.grouped_gemm import grouped_mm_reference, pick_rows
from moe_launch.kernels.moe import fast_experts
from moe_launch.trainer.moe.reference import experts_reference


def _plan(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    counts_E = torch.tensor(counts, dtype=torch.int32)
    offsets_E1 = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets_E1[1:] = torch.cumsum(counts_E, 0)
    return counts_E, offsets_E1


TILES = [tma.Tiles(16, 16, 16, 4, 2), tma.Tiles(32, 16, 16, 4, 2, group_m=3), tma.Tiles(16, 32, 32, 4, 2, group_m=2)]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t.BM}x{t.BN}x{t.BK}g{t.group_m}")
@pytest.mark.parametrize("kmajor", [True, False], ids=["b K-major", "b M-major"])
def test_rows_match_the_reference(tiles, kmajor):
    gen = torch.Generator().manual_seed(hash((tiles, kmajor)) % 2**31)
    E, K, M = 6, 48, 40
    counts = torch.randint(0, 45, (E,), generator=gen)
    counts[torch.randint(0, E, (2,), generator=gen)] = 0  # experts with no rows
    counts_E, offsets_E1 = _plan(counts.tolist())
    R = int(offsets_E1[-1])
    a_NK = torch.randn(R + 13, K, generator=gen)  # rows past R: never read into a valid row
    a_NK[R:] = float("nan")
    w = torch.randn(E, M, K, generator=gen) if kmajor else torch.randn(E, K, M, generator=gen)
    b_EKM = w.transpose(1, 2) if kmajor else w
    assert tma.b_kmajor(b_EKM) == kmajor
    c = tma.grouped_mm_persistent(a_NK, b_EKM, counts_E, offsets_E1, tiles=tiles)
    ref = grouped_mm_reference(a_NK[:R], b_EKM, counts_E, offsets_E1)
    assert rel_err(c[:R], ref) < 1e-5


def test_e4m3_rows_with_scales_match_the_emulation():
    gen = torch.Generator().manual_seed(3)
    E, K, M = 5, 64, 48
    counts_E, offsets_E1 = _plan([7, 0, 33, 1, 20])
    R = int(offsets_E1[-1])
    a = torch.randn(R, K, generator=gen) * torch.rand(R, 1, generator=gen) * 10  # rows of different magnitudes
    w = torch.randn(E, M, K, generator=gen) * 0.02
    aq, as_ = fp8.quantize_rows(a, impl="reference")
    bq, bs = fp8.quantize_operand(w.transpose(1, 2), impl="reference")
    c = tma.grouped_mm_persistent(aq, bq, counts_E, offsets_E1, as_, bs, tiles=tma.Tiles(16, 16, 32, 4, 2))
    assert c.dtype == torch.bfloat16
    ref = fp8.scaled_grouped_mm_reference(aq, as_, bq, bs, offsets_E1)
    assert rel_err(c.float(), ref.float()) < 1e-2  # both round to bf16 once; the interpreter's e4m3 dot adds a little


def test_operands_the_descriptors_cannot_read_are_refused():
    counts_E, offsets_E1 = _plan([4, 4])
    a = torch.randn(8, 48)
    assert tma.usable(a[:, :47], torch.randn(2, 47, 16))  # a row may end anywhere: its stride is what must align
    assert not tma.usable(torch.randn(8, 47), torch.randn(2, 47, 16))  # rows 188 bytes apart
    aq, _ = fp8.quantize_rows(a, impl="reference")
    bq_mmajor = torch.randn(2, 48, 16).to(fp8.E4M3)  # e4m3 b with M contiguous: Hopper's 8-bit MMA cannot read it
    assert not tma.usable(aq, bq_mmajor)
    with pytest.raises(ValueError, match="TMA descriptors"):
        tma.grouped_mm_persistent(aq, bq_mmajor, counts_E, offsets_E1, torch.ones(8), torch.ones(2, 16))
    with pytest.raises(ValueError, match="both for e4m3"):
        tma.grouped_mm_persistent(a, torch.randn(2, 16, 48).transpose(1, 2), counts_E, offsets_E1, torch.ones(8))


def test_the_layer_on_the_tma_path_matches_the_reference_layer(monkeypatch):
    calls = []
    kernel = tma.grouped_mm_persistent
    monkeypatch.setattr(tma, "grouped_mm_persistent", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    gen = torch.Generator().manual_seed(5)
    T, D, F, E, K = 24, 32, 16, 8, 2
    x = torch.randn(T, D, generator=gen, requires_grad=True)
    idx = random_idx(T, K, E, gen, skip=range(2, 3))
    w = torch.rand(T, K, generator=gen, requires_grad=True)
    ws = [(0.1 * torch.randn(E, a, b, generator=gen)).requires_grad_() for a, b in ((F, D), (F, D), (D, F))]
    dy = torch.randn(T, D, generator=gen)
    outs = []
    for fn, kw in ((fast_experts, {"gemm_impl": "tma"}), (experts_reference, {})):
        for t in (x, w, *ws):
            t.grad = None
        y = fn(x, idx, w, *ws, **kw)
        y.backward(dy)
        outs.append([y.detach()] + [t.grad for t in (x, w, *ws)])
    assert len(calls) == 6  # gate, up, down; dh and the two dx GEMMs (the weight gradients take their own kernel)
    for got, ref in zip(*outs):
        assert rel_err(got, ref) < 1e-5


def test_tma_is_taken_where_asked_and_readable():
    a, b = torch.randn(64, 32), torch.randn(4, 16, 32).transpose(1, 2)
    assert pick_rows("tma", a, b) == ("tma", None)  # a shape auto leaves to CUTLASS: the kernel's default tile
    assert pick_rows("tma", torch.randn(64, 31), torch.randn(4, 31, 16))[0] == "triton"  # unreadable: auto's path
    assert pick_rows("auto", a, b) == ("triton", None)  # the CPU: no CUTLASS path to compare with


def test_the_shape_choice():
    """Our kernel where it beat CUTLASS (512 to 1024 rows per expert, K and M up to 2048), CUTLASS elsewhere and
    where nothing was measured; FP8 with a short K runs one pipeline over a program's tiles."""
    olmoe_8k, olmoe_16k = 8192 * 8, 16384 * 8
    assert tma.choose(olmoe_8k, 2048, 2048, 64, scaled=True) == tma.default_tiles(scaled=True)
    assert tma.choose(olmoe_8k, 1024, 2048, 64, scaled=True).flatten
    assert tma.choose(olmoe_8k, 2048, 1024, 64, scaled=False) == tma.default_tiles(scaled=False)
    assert tma.choose(olmoe_16k, 2048, 1024, 128, scaled=False) is not None  # 128 fine-grained experts
    assert tma.choose(4096 * 8, 2048, 1024, 64, scaled=True) is not None  # 512 rows per expert
    for N, E in ((olmoe_16k, 64), (16384, 8), (2048 * 8, 64), (1024 * 8, 64)):  # 2048 rows per expert, coarse, 256,
        assert tma.choose(N, 2048, 2048, E, scaled=True) is None  # 128 rows per expert
    assert tma.choose(8192 * 8, 3584, 5120, 64, scaled=True) is None  # 1024 rows, FP8 past 2048: CUTLASS's fast tile
    assert tma.choose(8192 * 8, 3584, 2560, 64, scaled=False) is None  # bf16 past 2048: no gain at the layer
    assert tma.choose(64, 32, 16, 8, scaled=False) is None


def test_fp8_takes_our_kernel_where_cutlass_gets_only_its_slow_tile():
    """torch's FP8 grouped GEMM runs its fast tile only where two of (rows per expert, K, M) reach 2048; presenting
    rows supplies one of the two. With K and M both below 2048 (a model dim of 1536 and experts of 512, Granite-like)
    no presenting helps: our kernel takes the FP8 GEMMs there at any rows per expert from 512 on; bf16 is unchanged."""
    granite = 16384 * 8  # 3277 rows per expert over 40
    for K, M in ((1536, 1024), (512, 1536), (1536, 512), (1024, 1536)):  # gate+up, down, dh, dx
        assert fp8.rows_to_present(granite, 40, K, M) == granite  # nothing CUTLASS could be handed
        assert tma.choose(granite, K, M, 40, scaled=True) is not None
        assert tma.choose(granite, K, M, 40, scaled=False) is None
    assert tma.choose(granite, 512, 1536, 40, scaled=True).flatten  # short K: one pipeline over the tiles
    assert tma.choose(16384 * 8, 2048, 1024, 64, scaled=True) is None  # OLMoE at 16k: CUTLASS's large tile
    assert tma.choose(256 * 8, 1536, 1024, 40, scaled=True) is None  # 51 rows per expert: not measured


@pytest.mark.skipif(not host_has_gpu(9), reason="needs an sm90 GPU")
def test_compiled_kernel_on_the_gpu():
    out = run_compiled("gpu_grouped_gemm_tma.py")
    assert out.startswith("ok"), out


def test_the_config_picks_the_kernels_grouped_gemm():
    from moe_launch.conf.schema import MoEConfig
    from moe_launch.errors import ConfigError
    from moe_launch.trainer.moe import layer as layer_mod

    assert layer_mod.resolve_experts_fn("fast", "bf16", grouped_gemm="tma").keywords == {"gemm_impl": "tma"}
    assert layer_mod.resolve_experts_fn("fast", "bf16") is fast_experts  # auto: the kernels' own default
    on_cpu = layer_mod.resolve_experts_fn("auto", "bf16", grouped_gemm="torch")
    x, idx = torch.randn(6, 8), torch.tensor([[0, 1]] * 6)
    ws = [torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 8, 4)]
    assert on_cpu(x, idx, torch.ones(6, 2), *ws).shape == (6, 8)  # the reference there, which has no GEMM choice
    with pytest.raises(ConfigError, match="model.moe.grouped_gemm"):
        MoEConfig(grouped_gemm="cutlass")
