"""Each FastSparseMoE kernel equals its plain-torch reference on fresh random inputs (Triton interpreter on CPU).

Grid: tokens 1..4096, hidden 8..256, experts 1..64, top-k 1..8, ragged segments, experts that receive zero tokens,
a rank owning a sub-range of the experts, and duplicate experts within a token. Big T only with tiny hidden (the
interpreter is slow). Index kernels must match exactly; arithmetic kernels within fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from helpers_gpu import host_has_gpu
from kernel_helpers import input_generator, random_idx, rel_err, run_compiled

from moe_launch.kernels import gather, grouped_gemm, reduce, swiglu
from moe_launch.kernels.index_gen import route_indices
from moe_launch.kernels.token_count import boundaries, count_tokens

# (T, K, global experts, e_start, e_end, experts never chosen)
ROUTES = [
    (1, 1, 1, 0, 1, range(0)),
    (5, 2, 4, 0, 4, range(0)),
    (100, 3, 8, 2, 6, range(0)),  # sub-range
    (333, 8, 8, 0, 8, range(0)),  # K == E: every token uses every expert
    (1000, 4, 64, 0, 64, range(10, 30)),  # 20 experts with zero tokens
    (777, 8, 64, 16, 48, range(20, 24)),  # sub-range with zero-token experts inside it
    (4096, 8, 64, 0, 64, range(0)),
    (4096, 1, 16, 5, 6, range(0)),  # one local expert out of 16
]
FIELDS = ("counts_E", "ends_E", "offsets_E1", "row_token_N", "row_pair_N", "pair_row_TK", "num_rows")


@pytest.fixture
def gen() -> torch.Generator:
    return input_generator()


@pytest.mark.parametrize("T,K,EG,e0,e1,skip", ROUTES)
def test_count_and_index_match_reference(T, K, EG, e0, e1, skip, gen):
    idx = random_idx(T, K, EG, gen, skip)
    p_tri, p_ref = count_tokens(idx, e0, e1), count_tokens(idx, e0, e1, impl="reference")
    assert torch.equal(p_tri, p_ref)
    counts_E = boundaries(p_tri)[0]
    local = (idx >= e0) & (idx < e1)
    assert torch.equal(counts_E.long(), torch.bincount(idx[local] - e0, minlength=e1 - e0))
    a, b = route_indices(idx, e0, e1), route_indices(idx, e0, e1, impl="reference")
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for e in skip:
        if e0 <= e < e1:
            assert a.counts_E[e - e0] == 0


def test_index_with_duplicate_experts_in_a_token(gen):
    idx = torch.randint(0, 6, (500, 5), generator=gen)  # a token may pick the same expert twice: two rows
    a, b = route_indices(idx, 1, 5), route_indices(idx, 1, 5, impl="reference")
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_rows_are_stable_and_consistent(gen):
    """Rows of each expert list their pairs in increasing pair order; input and output indices agree."""
    idx = random_idx(2000, 8, 64, gen, range(3, 9))
    p = route_indices(idx, 0, 64)
    R = int(p.num_rows)
    pairs = p.row_pair_N[:R].long()
    assert torch.equal(p.row_token_N[:R].long(), pairs // 8)
    assert torch.equal(p.pair_row_TK.reshape(-1)[pairs], torch.arange(R, dtype=torch.int32))
    for e in range(64):
        seg = pairs[p.offsets_E1[e] : p.offsets_E1[e + 1]]
        assert bool((idx.reshape(-1)[seg] == e).all()) and bool((seg[1:] > seg[:-1]).all())
    assert bool((p.row_token_N[R:] == -1).all())


@pytest.mark.parametrize("T,K,D", [(1, 1, 8), (513, 3, 256), (4096, 8, 8), (50, 2, 12), (50, 2, 7)])
def test_gather(T, K, D, gen):
    idx = random_idx(T, K, 16, gen, range(2, 5))
    p = route_indices(idx, 1, 13)
    x = torch.randn(T, D, generator=gen)
    R = int(p.num_rows)
    assert torch.equal(gather.gather_rows(x, p.row_token_N, p.num_rows)[:R],
                       gather.gather_rows_reference(x, p.row_token_N, p.num_rows)[:R])


# (T, K, experts, D (contraction), M (output)), with zero-token experts in every case but the first
GEMMS = [(1, 1, 1, 8, 16), (40, 2, 5, 24, 40), (30, 2, 3, 9, 6), (300, 4, 16, 256, 64), (64, 8, 24, 64, 256),
         (4096, 8, 64, 8, 16)]


@pytest.mark.parametrize("T,K,E,Dk,M", GEMMS)
def test_grouped_mm_and_wgrad(T, K, E, Dk, M, gen):
    idx = random_idx(T, K, E, gen, range(1, 1 + E // 4))
    p = route_indices(idx, 0, E)
    R = int(p.num_rows)
    a = torch.randn(T * K, Dk, generator=gen)
    w = torch.randn(E, M, Dk, generator=gen)  # nn.Linear layout: the layer calls it with w.transpose(1, 2)
    for b_EKM in (w.transpose(1, 2), torch.randn(E, Dk, M, generator=gen)):  # strided view and contiguous
        c = grouped_gemm.grouped_mm(a, b_EKM, p, impl="triton")
        c_ref = grouped_gemm.grouped_mm(a, b_EKM, p, impl="reference")
        assert rel_err(c[:R], c_ref[:R]) <= 1e-6
    dc = torch.randn(T * K, M, generator=gen)
    g = grouped_gemm.grouped_mm_wgrad(dc, a, p, impl="triton")
    g_ref = grouped_gemm.grouped_mm_wgrad(dc, a, p, impl="reference")
    assert rel_err(g, g_ref) <= 1e-6
    assert bool((g[p.counts_E == 0] == 0).all())  # experts without rows get exactly zero gradient


@pytest.mark.parametrize("N,Fh", [(1, 8), (700, 100), (32768, 8)])
def test_swiglu(N, Fh, gen):
    g, u, dh = torch.randn(3, N, Fh, generator=gen)
    R = torch.tensor(N - N // 3, dtype=torch.int32)  # rows >= R are skipped
    r = int(R)
    assert rel_err(swiglu.swiglu_fwd(g, u, R)[:r], swiglu.swiglu_fwd_reference(g, u, R)[:r]) <= 1e-6
    for got, want in zip(swiglu.swiglu_bwd(g, u, dh, R), swiglu.swiglu_bwd_reference(g, u, dh, R)):
        assert rel_err(got[:r], want[:r]) <= 1e-6


@pytest.mark.parametrize("tile", [swiglu.RowTile(1, 128, 4), swiglu.RowTile(8, 64, 8), swiglu.RowTile(16, 256, 2)])
def test_swiglu_gives_the_same_rows_on_any_tile(tile, gen):
    """The tile only decides which program computes which elements (benchmarks/swiglu_tiles.py picks it by speed):
    rows per program that do not divide N (powers of two, as tl.arange needs), column blocks narrower or wider than F,
    any warps."""
    N, Fh, T = 50, 200, 25
    g, u, dh = torch.randn(3, N, Fh, generator=gen)
    R = torch.tensor(45, dtype=torch.int32)
    routing = (torch.rand(T, 2, generator=gen), torch.randperm(N, generator=gen).int())
    assert torch.equal(swiglu.swiglu_fwd_triton(g, u, R, tile=tile)[:45], swiglu.swiglu_fwd_triton(g, u, R)[:45])
    got = swiglu.swiglu_bwd_triton(g, u, dh, R, routing=routing, tile=tile)
    want = swiglu.swiglu_bwd_triton(g, u, dh, R, routing=routing)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a[:45], b[:45])
    assert rel_err(got[3], want[3]) <= 1e-6  # the routing weight's gradient sums a row, in the tile's order
    if tile.cols < Fh:  # quantizing needs the row's amax in one tile
        with pytest.raises(ValueError, match="whole rows"):
            swiglu.swiglu_bwd_triton(g, u, dh, R, quant=True, tile=tile)


@pytest.mark.parametrize("Fh", [1, 200, 512, 768, 1024, 1100, 2880])
def test_default_gpu_tiles_hold_whole_rows_where_they_quantize(Fh):
    """Every kernel's default GPU tile launches: the quantizing ones, wherever the row fits one tile (fuses_fp8), take
    it whole, and a backward program stays near 1,024 elements whatever F (its registers limit it, not the rows)."""
    for kernel in swiglu.KERNELS:
        t = swiglu.row_tile(Fh, True, kernel)
        if kernel.endswith("fp8") and swiglu.fuses_fp8(Fh):
            assert t.cols >= Fh
            swiglu._blocks(4096, Fh, True, None, kernel)  # raises on a tile that splits a row
        if kernel.startswith("bwd"):
            assert t.rows * t.cols <= 1024 or t.rows == 1


@pytest.mark.parametrize("T,K,EG,e0,e1,D", [(1, 1, 1, 0, 1, 8), (257, 3, 12, 4, 9, 200), (4096, 8, 64, 8, 40, 8)])
def test_combine_forward(T, K, EG, e0, e1, D, gen):
    idx = random_idx(T, K, EG, gen)
    p = route_indices(idx, e0, e1)
    rows, rows2 = torch.randn(2, T * K, D, generator=gen)
    w = torch.rand(T, K, generator=gen)
    assert rel_err(reduce.combine(rows, p.pair_row_TK, w), reduce.combine_reference(rows, p.pair_row_TK, w)) <= 1e-6
    assert rel_err(reduce.combine(rows, p.pair_row_TK, None, rows2_ND=rows2),
                   reduce.combine_reference(rows, p.pair_row_TK, None, rows2_ND=rows2)) <= 1e-6


@pytest.mark.parametrize("T,K,EG,e0,e1,Fh", [(1, 1, 1, 0, 1, 8), (257, 3, 12, 4, 9, 200), (300, 2, 4, 1, 3, 1100)])
def test_swiglu_backward_with_routing_weights(T, K, EG, e0, e1, Fh, gen):
    """The routed SwiGLU backward against the layer's math: dh' = dy[t] @ w_down for row r of pair (t, k), the rows'
    output y_r = h_r @ w_down^T, and the reduction y[t] = sum_k w[t,k] y_r. Autograd of that chain gives dg, du; the
    routing weight's gradient is <y_r, dy[t]>; the down weight's operand is w*h. F = 1100 spans two column blocks."""
    idx = random_idx(T, K, EG, gen)
    p = route_indices(idx, e0, e1)
    R, D = int(p.num_rows), 24
    g, u = torch.randn(2, T * K, Fh, generator=gen)
    w_down = torch.randn(D, Fh, generator=gen) / Fh ** 0.5  # one expert's weight for every row: the math is per row
    dy = torch.randn(T, D, generator=gen)
    w = torch.rand(T, K, generator=gen)
    dyg_ND = gather.gather_rows(dy, p.row_token_N, p.num_rows)
    dg, du, wh, dw = swiglu.swiglu_bwd(g, u, dyg_ND @ w_down, p.num_rows, routing=(w, p.row_pair_N))

    gq, uq, wq = (t.clone().requires_grad_() for t in (g[:R], u[:R], w))
    y_ND = (torch.nn.functional.silu(gq) * uq) @ w_down.T
    y_TD = reduce.combine_reference(torch.cat([y_ND, y_ND.new_zeros(T * K - R, D)]), p.pair_row_TK, wq)
    dg_ref, du_ref, dw_ref = torch.autograd.grad(y_TD, (gq, uq, wq), dy)
    assert rel_err(dg[:R], dg_ref) <= 1e-5 and rel_err(du[:R], du_ref) <= 1e-5
    w_N = w.reshape(-1)[p.row_pair_N[:R].long()]
    assert rel_err(wh[:R], w_N[:, None] * swiglu.swiglu_fwd_reference(g[:R], u[:R], p.num_rows)) <= 1e-6
    local = p.pair_row_TK >= 0
    assert bool((dw[~local] == 0).all())  # non-local pairs: no router-weight gradient from this rank
    # dw[t, k] = sum_d,f dy_d W_df h_f, summed in another order than the reference: bound each element by the size of
    # its terms, sum |dy_d W_df h_f|, as fp32 summation error scales with it (a relative bound fails on cancellation)
    terms_TK = torch.zeros_like(dw)
    rows = p.pair_row_TK[local].long()
    h_abs = (torch.nn.functional.silu(g[:R]) * u[:R]).abs() @ w_down.abs().T
    terms_TK[local] = (h_abs[rows] * dy.abs()[local.nonzero()[:, 0]]).sum(-1)
    assert bool(((dw - dw_ref).abs() <= 1e-5 * terms_TK).all()), ((dw - dw_ref).abs().max(), terms_TK.max())
    ref = swiglu.swiglu_bwd_reference(g, u, dyg_ND @ w_down, p.num_rows, routing=(w, p.row_pair_N))
    for got, want in zip((dg, du, wh), ref[:3]):
        assert rel_err(got[:R], want[:R]) <= 1e-6
    assert bool(((dw - ref[3]).abs() <= 1e-5 * terms_TK).all())


def test_cutlass_alignment_rule():
    """The torch (CUTLASS) grouped GEMM takes only 16-byte aligned operands; anything else goes to our Triton kernel."""
    w = torch.zeros(4, 16, 24, dtype=torch.bfloat16)
    assert grouped_gemm.aligned_16(w) and grouped_gemm.aligned_16(w.transpose(1, 2))  # strides 384, 24: x 8
    odd = torch.zeros(4, 16, 20, dtype=torch.bfloat16)  # rows of 40 bytes
    assert not grouped_gemm.aligned_16(odd) and not grouped_gemm.aligned_16(odd.transpose(1, 2))
    flat = torch.zeros(64 * 24, dtype=torch.bfloat16)
    assert grouped_gemm.aligned_16(flat[24:].view(-1, 24))  # starts 48 bytes in
    assert not grouped_gemm.aligned_16(flat[4:4 + 63 * 24].view(-1, 24))  # starts 8 bytes in
    assert grouped_gemm.aligned_16(torch.zeros(1, 5, dtype=torch.bfloat16))  # one row: no stride to check
    assert not grouped_gemm.torch_path_ok(w)  # CPU tensors never take the CUTLASS path


@pytest.mark.skipif(not host_has_gpu(), reason="needs a CUDA device")
def test_unaligned_sizes_run_on_the_gpu():
    """Sizes that break CUTLASS's 16-byte rule run and match the reference: gpu_unaligned.py in a process with the
    host's GPU and compiled Triton."""
    assert run_compiled("gpu_unaligned.py").startswith("ok unaligned")
