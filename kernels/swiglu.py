"""SwiGLU between the grouped GEMMs: h = silu(g) * u, forward and backward, fused and row-bounded.

Shapes: N row capacity, F expert hidden dim, R = plan.num_rows valid rows (device scalar; rows >= R are skipped).
The backward also re-creates h (needed for the down projection's weight gradient) so h need not be saved, and with
the routing weights (swiglu_bwd's `routing`) applies them and returns their gradient, so y_ND need not be saved.
FP8 experts (kernels/moe.py): swiglu_fwd_fp8 hands the down GEMM h's e4m3 rows without writing h, swiglu_bwd_fp8
adds the e4m3 rows of [dg du] for the input-gradient GEMM; both quantize inside the kernel when a row fits one tile
(F <= 1024) and equal kernels.fp8.quantize_rows bit for bit.
Math in fp32: silu(g) = g*s, s = sigmoid(g); d silu/dg = s * (1 + g * (1 - s)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2, row_buffer, unit_of
from moe_launch.kernels.fp8 import E4M3, _encode, _scales, quantize_rows


@triton.jit
def _quantize_rows_into(v, dtype, q_ptrs, mask, SOFT_ROUND: tl.constexpr):
    """FP8 rows of a tile holding whole rows: v rounded to the stored dtype first (the values kernels.fp8 would read
    back), scaled by the row's amax; writes the codes, returns the row scales."""
    v = v.to(dtype).to(tl.float32)
    s, inv_s = _scales(tl.max(tl.abs(v), axis=1), True)
    tl.store(q_ptrs, _encode(v, inv_s, q_ptrs.dtype.element_ty, SOFT_ROUND), mask=mask)
    return s


@triton.jit
def _swiglu_fwd_kernel(
    g_ptr, u_ptr, h_ptr, num_rows_ptr,
    q_ptr, s_ptr,  # QUANT: h as e4m3 rows [N, F] and their scales [N] instead of h itself
    Fdim, stride_g, stride_u, stride_h, stride_q,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, QUANT: tl.constexpr, SOFT_ROUND: tl.constexpr, UNIT: tl.constexpr,
):
    # Fdim and the strides arrive divided by UNIT (_launch.unit_of): rows in 16-byte vectors where F is a multiple of 8
    Fdim, stride_g, stride_u, stride_h, stride_q = (Fdim * UNIT, stride_g * UNIT, stride_u * UNIT, stride_h * UNIT,
                                                    stride_q * UNIT)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_ok = rows < tl.load(num_rows_ptr)
    mask = row_ok[:, None] & (cols < Fdim)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    if QUANT:  # the whole row is in this tile (one column block)
        s = _quantize_rows_into(h, g_ptr.dtype.element_ty, q_ptr + r64 * stride_q + cols[None, :], mask, SOFT_ROUND)
        tl.store(s_ptr + rows, s, mask=row_ok)
    else:
        tl.store(h_ptr + r64 * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, h_ptr, num_rows_ptr,
    q_ptr, s_ptr,  # QUANT: also [dg du] as e4m3 rows [N, 2F] (one scale per row over both) and the scales [N]
    w_ptr, row_pair_ptr, dw_ptr,  # ROUTED: w [T*K], row_pair int32 [N], dw [T*K] (zeroed: non-local pairs stay 0)
    Fdim, stride_g, stride_u, stride_dh, stride_dg, stride_du, stride_h, stride_q,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, QUANT: tl.constexpr, ROUTED: tl.constexpr,
    SOFT_ROUND: tl.constexpr, UNIT: tl.constexpr,
):
    Fdim, stride_g, stride_u, stride_dh = Fdim * UNIT, stride_g * UNIT, stride_u * UNIT, stride_dh * UNIT  # as above
    stride_dg, stride_du, stride_h, stride_q = stride_dg * UNIT, stride_du * UNIT, stride_h * UNIT, stride_q * UNIT
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < tl.load(num_rows_ptr)
    r64 = rows.to(tl.int64)[:, None]
    if ROUTED:
        pair = tl.load(row_pair_ptr + rows, mask=row_ok, other=0)
        w = tl.load(w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dw = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, Fdim, BLOCK_F):  # one block when QUANT: the row's amax is taken in registers
        cols = c0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < Fdim)[None, :]
        g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + r64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        h = silu * u
        if ROUTED:  # dh holds dy @ w_down of the unweighted rows: <h, dh> is the routing weight's gradient
            dw += tl.sum(h * dh, axis=1)
            dh = dh * w
            h = h * w
        dg = dh * u * s * (1.0 + g * (1.0 - s))
        du = dh * silu
        tl.store(dg_ptr + r64 * stride_dg + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + r64 * stride_du + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(h_ptr + r64 * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
        if QUANT:  # amax over dg and du together
            dgr = dg.to(dg_ptr.dtype.element_ty).to(tl.float32)
            dur = du.to(du_ptr.dtype.element_ty).to(tl.float32)
            sc, inv_s = _scales(tl.maximum(tl.max(tl.abs(dgr), axis=1), tl.max(tl.abs(dur), axis=1)), True)
            q_row = q_ptr + r64 * stride_q + cols[None, :]
            tl.store(q_row, _encode(dgr, inv_s, q_ptr.dtype.element_ty, SOFT_ROUND), mask=mask)
            tl.store(q_row + Fdim, _encode(dur, inv_s, q_ptr.dtype.element_ty, SOFT_ROUND), mask=mask)
            tl.store(s_ptr + rows, sc, mask=row_ok)
    if ROUTED:
        tl.store(dw_ptr + pair, dw.to(dw_ptr.dtype.element_ty), mask=row_ok)


_MAX_BLOCK_F = 1024


@dataclass(frozen=True)
class RowTile:
    """How the SwiGLU kernels cut [N, F]: `rows` per program, `cols` per column block (the whole row when quantizing,
    fuses_fp8), `warps` per program. benchmarks/swiglu_tiles.py times the candidates."""
    rows: int
    cols: int
    warps: int = 4


KERNELS = ("fwd", "fwd fp8", "bwd", "bwd fp8")  # the four launches: SwiGLU forward / backward, each with FP8 rows


def row_tile(Fdim: int, cuda: bool, kernel: str) -> RowTile:
    """The default tile of one of KERNELS, 4 warps. On the GPU the forward takes 4,096 elements per program and the
    backward 1,024: it holds g, u, dh, their two gradients, h and the routing sums at once, and at 4,096 elements
    Hopper fits only 2-3 of its programs per SM (139 registers a thread, 191 with FP8 rows). benchmarks/swiglu_tiles.py
    times the candidates (its --layer run swaps this function). The interpreter takes larger tiles: it pays per
    program, not per element."""
    cols = min(next_pow2(Fdim), _MAX_BLOCK_F)
    elements = (1024 if kernel.startswith("bwd") else 4096) if cuda else 65536
    return RowTile(max(1, elements // cols), cols)


def _blocks(N: int, Fdim: int, cuda: bool, tile: RowTile | None, kernel: str) -> tuple[RowTile, tuple[int, int]]:
    t = tile or row_tile(Fdim, cuda, kernel)
    if kernel.endswith("fp8") and t.cols < Fdim:  # a row's scale needs its amax over the whole row in one tile
        raise ValueError(f"SwiGLU {kernel} quantizes whole rows per tile: cols {t.cols} < F {Fdim}")
    return t, (max(1, triton.cdiv(N, t.rows)), triton.cdiv(Fdim, t.cols))


def _in_units(*ints: int) -> tuple[list[int], int]:
    u = unit_of(*ints)
    return [i // u for i in ints], u


def _unit_stride(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]  # kernels address rows as base + r*stride + c


def swiglu_fwd_triton(g_NF: torch.Tensor, u_NF: torch.Tensor, num_rows: torch.Tensor,
                      tile: RowTile | None = None) -> torch.Tensor:
    g_NF, u_NF = _unit_stride(g_NF, u_NF)
    N, Fdim = g_NF.shape
    h_NF = row_buffer(N, Fdim, g_NF.dtype, g_NF.device)
    t, grid = _blocks(N, Fdim, g_NF.is_cuda, tile, "fwd")
    ints, u = _in_units(Fdim, g_NF.stride(0), u_NF.stride(0), h_NF.stride(0), 0)
    launch(_swiglu_fwd_kernel, grid, g_NF, u_NF, h_NF, num_rows, h_NF, h_NF, *ints, BLOCK_R=t.rows, BLOCK_F=t.cols,
           QUANT=False, SOFT_ROUND=False, UNIT=u, num_warps=t.warps)
    return h_NF


def swiglu_bwd_triton(g_NF, u_NF, dh_NF, num_rows, quant: bool = False, routing=None, tile: RowTile | None = None):
    """-> (dg_NF, du_NF, h_NF), with routing also dw_TK, and with quant (the whole row in one tile, see fuses_fp8)
    the e4m3 rows of [dg du] and their scales; rows >= R unspecified. routing: see swiglu_bwd. tile: row_tile's
    by default; with quant its cols must cover F."""
    g_NF, u_NF, dh_NF = _unit_stride(g_NF, u_NF, dh_NF)
    N, Fdim = g_NF.shape
    t, grid = _blocks(N, Fdim, g_NF.is_cuda, tile, "bwd fp8" if quant else "bwd")  # refuses a bad tile first
    dg_NF, du_NF, h_NF = (row_buffer(N, Fdim, g_NF.dtype, g_NF.device) for _ in range(3))
    q_N2F = torch.empty(N, 2 * Fdim, dtype=E4M3, device=g_NF.device) if quant else h_NF
    s_N = torch.empty(N, dtype=torch.float32, device=g_NF.device) if quant else h_NF
    w_P, row_pair_N, dw_P = h_NF, h_NF, h_NF  # unused without routing
    if routing is not None:
        w_TK, row_pair_N = routing
        w_P = w_TK.contiguous().view(-1)
        dw_P = torch.zeros_like(w_P)
    ints, u = _in_units(Fdim, *(b.stride(0) for b in (g_NF, u_NF, dh_NF, dg_NF, du_NF, h_NF, q_N2F)))
    launch(_swiglu_bwd_kernel, grid[:1], g_NF, u_NF, dh_NF, dg_NF, du_NF, h_NF, num_rows, q_N2F, s_N, w_P,
           row_pair_N, dw_P, *ints, BLOCK_R=t.rows, BLOCK_F=t.cols, QUANT=quant, ROUTED=routing is not None,
           SOFT_ROUND=not g_NF.is_cuda, UNIT=u, num_warps=t.warps)
    out = (dg_NF, du_NF, h_NF) if routing is None else (dg_NF, du_NF, h_NF, dw_P.view(routing[0].shape))
    return (*out, q_N2F, s_N) if quant else out


def fuses_fp8(Fdim: int) -> bool:
    """The FP8 variants quantize inside the SwiGLU kernels when a row fits one tile (one column block)."""
    return Fdim <= _MAX_BLOCK_F


def swiglu_fwd_fp8(g_NF: torch.Tensor, u_NF: torch.Tensor, num_rows: torch.Tensor, capacity: int = 0,
                   tile: RowTile | None = None):
    """-> (hq_NF e4m3, hs_N fp32): h quantized per row as kernels.fp8.quantize_rows(h) would, bit for bit, without
    writing h itself where the row fits one tile; else swiglu_fwd then quantize_rows. capacity: where fused, the
    outputs hold max(N, capacity) rows (the down GEMM's presented rows, kernels/fp8.py); past N unused."""
    N, Fdim = g_NF.shape
    if not fuses_fp8(Fdim):
        return quantize_rows(swiglu_fwd(g_NF, u_NF, num_rows), num_rows)
    t, grid = _blocks(N, Fdim, g_NF.is_cuda, tile, "fwd fp8")  # refuses a bad tile first
    g_NF, u_NF = _unit_stride(g_NF, u_NF)
    q_NF = torch.empty(max(N, capacity), Fdim, dtype=E4M3, device=g_NF.device)
    s_N = torch.empty(max(N, capacity), dtype=torch.float32, device=g_NF.device)
    ints, u = _in_units(Fdim, g_NF.stride(0), u_NF.stride(0), 0, q_NF.stride(0))
    launch(_swiglu_fwd_kernel, grid, g_NF, u_NF, g_NF, num_rows, q_NF, s_N, *ints, BLOCK_R=t.rows, BLOCK_F=t.cols,
           QUANT=True, SOFT_ROUND=not g_NF.is_cuda, UNIT=u, num_warps=t.warps)
    return q_NF, s_N


def swiglu_bwd_fp8(g_NF, u_NF, dh_NF, num_rows, routing=None):
    """-> swiglu_bwd's tuple plus (q_N2F, s_N), the e4m3 rows of [dg du] (one scale per row over both), as
    kernels.fp8.quantize_rows(dg, tail=du) would, bit for bit: in the same kernel where the row fits one tile."""
    if fuses_fp8(g_NF.shape[1]):
        return swiglu_bwd_triton(g_NF, u_NF, dh_NF, num_rows, quant=True, routing=routing)
    grads = swiglu_bwd(g_NF, u_NF, dh_NF, num_rows, routing=routing)
    return (*grads, *quantize_rows(grads[0], num_rows, tail=grads[1]))


def swiglu_fwd_reference(g_NF, u_NF, num_rows):
    return (F.silu(g_NF.float()) * u_NF.float()).to(g_NF.dtype)


def swiglu_bwd_reference(g_NF, u_NF, dh_NF, num_rows, routing=None):
    g = g_NF.detach().float().requires_grad_()
    u = u_NF.detach().float().requires_grad_()
    h = F.silu(g) * u
    dh = dh_NF.float()
    if routing is not None:
        w_TK, row_pair_N = routing
        valid = row_pair_N >= 0
        w_N = torch.where(valid, w_TK.reshape(-1).float()[row_pair_N.clamp(min=0).long()], 0.0)[:, None]
        dw_P = torch.zeros(w_TK.numel(), dtype=torch.float32, device=w_TK.device)
        dw_P[row_pair_N[valid].long()] = (h.detach() * dh).sum(1)[valid]
        dh = dh * w_N
    dg, du = torch.autograd.grad(h, (g, u), dh)
    h = h.detach() if routing is None else h.detach() * w_N
    out = dg.to(g_NF.dtype), du.to(g_NF.dtype), h.to(g_NF.dtype)
    return out if routing is None else (*out, dw_P.to(w_TK.dtype).view(w_TK.shape))


def swiglu_fwd(g_NF, u_NF, num_rows, impl: str = "triton"):
    return (swiglu_fwd_triton if impl == "triton" else swiglu_fwd_reference)(g_NF, u_NF, num_rows)


def swiglu_bwd(g_NF, u_NF, dh_NF, num_rows, impl: str = "triton", routing=None):
    """-> (dg_NF, du_NF, h_NF): the gradients of h = silu(g) * u given dh, and h re-created.
    routing (w_TK, plan.row_pair_N): dh holds the rows' gradient before their routing weight, dy[t] @ w_down for
    row r of pair (t, k). Then dg and du are taken for w[t,k] * dh, h comes back as w[t,k] * h (the down projection's
    weight-gradient operand), and dw_TK[t, k] = <h, dh> (dy[t] . y_r, the routing weight's gradient; 0 for pairs
    no row serves) is returned fourth, so that y_ND need not be kept for the backward."""
    fn = swiglu_bwd_triton if impl == "triton" else swiglu_bwd_reference
    return fn(g_NF, u_NF, dh_NF, num_rows, routing=routing)
