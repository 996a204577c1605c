"""SwiGLU between the grouped GEMMs: h = silu(g) * u, forward and backward, fused and row-bounded.

Shapes: N row capacity, F expert hidden dim, R = plan.num_rows valid rows (device scalar; rows >= R are skipped).
The backward also re-creates h (needed for the down projection's weight gradient) so h need not be saved.
Math in fp32: silu(g) = g*s, s = sigmoid(g); d silu/dg = s * (1 + g * (1 - s)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2


@triton.jit
def _swiglu_fwd_kernel(
    g_ptr, u_ptr, h_ptr, num_rows_ptr,
    Fdim, stride_g, stride_u, stride_h,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < tl.load(num_rows_ptr))[:, None] & (cols < Fdim)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + r64 * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, h_ptr, num_rows_ptr,
    Fdim, stride_g, stride_u, stride_dh, stride_dg, stride_du, stride_h,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < tl.load(num_rows_ptr))[:, None] & (cols < Fdim)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + r64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    tl.store(dg_ptr + r64 * stride_dg + cols[None, :], (dh * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty),
             mask=mask)
    tl.store(du_ptr + r64 * stride_du + cols[None, :], (dh * silu).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(h_ptr + r64 * stride_h + cols[None, :], (silu * u).to(h_ptr.dtype.element_ty), mask=mask)


def _blocks(N: int, Fdim: int, cuda: bool) -> tuple[int, int, tuple[int, int]]:
    BLOCK_F = min(next_pow2(Fdim), 1024)
    BLOCK_R = max(1, (4096 if cuda else 65536) // BLOCK_F)
    return BLOCK_R, BLOCK_F, (max(1, triton.cdiv(N, BLOCK_R)), triton.cdiv(Fdim, BLOCK_F))


def _unit_stride(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]  # kernels address rows as base + r*stride + c


def swiglu_fwd_triton(g_NF: torch.Tensor, u_NF: torch.Tensor, num_rows: torch.Tensor) -> torch.Tensor:
    g_NF, u_NF = _unit_stride(g_NF, u_NF)
    N, Fdim = g_NF.shape
    h_NF = torch.empty(N, Fdim, dtype=g_NF.dtype, device=g_NF.device)
    BLOCK_R, BLOCK_F, grid = _blocks(N, Fdim, g_NF.is_cuda)
    launch(_swiglu_fwd_kernel, grid, g_NF, u_NF, h_NF, num_rows, Fdim, g_NF.stride(0), u_NF.stride(0),
           h_NF.stride(0), BLOCK_R=BLOCK_R, BLOCK_F=BLOCK_F)
    return h_NF


def swiglu_bwd_triton(g_NF, u_NF, dh_NF, num_rows):
    """-> (dg_NF, du_NF, h_NF); rows >= R unspecified."""
    g_NF, u_NF, dh_NF = _unit_stride(g_NF, u_NF, dh_NF)
    N, Fdim = g_NF.shape
    dg_NF, du_NF, h_NF = (torch.empty(N, Fdim, dtype=g_NF.dtype, device=g_NF.device) for _ in range(3))
    BLOCK_R, BLOCK_F, grid = _blocks(N, Fdim, g_NF.is_cuda)
    launch(_swiglu_bwd_kernel, grid, g_NF, u_NF, dh_NF, dg_NF, du_NF, h_NF, num_rows, Fdim,
           g_NF.stride(0), u_NF.stride(0), dh_NF.stride(0), dg_NF.stride(0), du_NF.stride(0), h_NF.stride(0),
           BLOCK_R=BLOCK_R, BLOCK_F=BLOCK_F)
    return dg_NF, du_NF, h_NF


def swiglu_fwd_reference(g_NF, u_NF, num_rows):
    return (F.silu(g_NF.float()) * u_NF.float()).to(g_NF.dtype)


def swiglu_bwd_reference(g_NF, u_NF, dh_NF, num_rows):
    g = g_NF.detach().float().requires_grad_()
    u = u_NF.detach().float().requires_grad_()
    h = F.silu(g) * u
    dg, du = torch.autograd.grad(h, (g, u), dh_NF.float())
    return dg.to(g_NF.dtype), du.to(g_NF.dtype), h.detach().to(g_NF.dtype)


def swiglu_fwd(g_NF, u_NF, num_rows, impl: str = "triton"):
    return (swiglu_fwd_triton if impl == "triton" else swiglu_fwd_reference)(g_NF, u_NF, num_rows)


def swiglu_bwd(g_NF, u_NF, dh_NF, num_rows, impl: str = "triton"):
    return (swiglu_bwd_triton if impl == "triton" else swiglu_bwd_reference)(g_NF, u_NF, dh_NF, num_rows)
