"""Stage 5 of FastSparseMoE: the output reduction (Optimus Algorithm 1, lines 81-113).

Shapes: T tokens, K top-k, D model dim, N row capacity, pair_row_TK the output indices of RoutePlan (-1: the pair's
expert is not local, it contributes nothing here).

  y_TD[t] = sum_k w_TK[t,k] * rows_ND[pair_row_TK[t,k]]   (sum over local k, in k order, fp32 accumulator)
Its backward is a gather of dy (kernels/gather.py) with w applied, and dw_TK[t,k] = <rows_ND[row], dy_TD[t]>; the
expert stage takes both inside its SwiGLU backward (kernels/swiglu.py), so the rows need not be kept. The kernel walks
tokens, so each output element is written once: no atomics, deterministic. With no weights it is also the gather's
backward (each token sums the gradients of its rows); `rows2_ND` adds a second buffer in the same pass (the input
gradient of the gate and the up projection arrive as two buffers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2, unit_of


@triton.jit
def _combine_fwd_kernel(
    rows_ptr, rows2_ptr, pair_row_ptr, w_ptr, out_ptr,  # rows/rows2 [N, D]; pair_row int32 [T, K]; w [T, K]; out [T, D]
    T, K, D, stride_rows, stride_rows2, stride_out,
    HAS_W: tl.constexpr, HAS_ROWS2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr,
):
    # D and the strides arrive divided by UNIT (_launch.unit_of): rows in 16-byte vectors where D is a multiple of 8
    D, stride_rows, stride_rows2, stride_out = D * UNIT, stride_rows * UNIT, stride_rows2 * UNIT, stride_out * UNIT
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = toks < T
    col_ok = cols < D
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in range(K):
        row = tl.load(pair_row_ptr + toks * K + k, mask=tok_ok, other=-1)
        ok = row >= 0
        r64 = row.to(tl.int64)[:, None]
        m = ok[:, None] & col_ok[None, :]
        v = tl.load(rows_ptr + r64 * stride_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_ROWS2:
            v += tl.load(rows2_ptr + r64 * stride_rows2 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            v *= tl.load(w_ptr + toks * K + k, mask=ok, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_ok[:, None] & col_ok[None, :])


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def combine_triton(rows_ND, pair_row_TK, w_TK=None, rows2_ND=None, out_dtype=None):
    T, K = pair_row_TK.shape
    D = rows_ND.shape[1]
    out_TD = torch.empty(T, D, dtype=out_dtype or rows_ND.dtype, device=rows_ND.device)
    if T == 0:
        return out_TD
    BLOCK_D = min(next_pow2(D), 256 if rows_ND.is_cuda else 4096)
    BLOCK_T = max(1, (2048 if rows_ND.is_cuda else 65536) // BLOCK_D)
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))
    pair_row_TK, rows_ND = pair_row_TK.contiguous(), _unit_stride(rows_ND)  # kernels index [t*K + k] and rows
    w = w_TK.contiguous() if w_TK is not None else pair_row_TK  # unused when HAS_W is False
    r2 = _unit_stride(rows2_ND) if rows2_ND is not None else rows_ND
    u = unit_of(D, rows_ND.stride(0), r2.stride(0), out_TD.stride(0))
    launch(_combine_fwd_kernel, grid, rows_ND, r2, pair_row_TK, w, out_TD, T, K, D // u, rows_ND.stride(0) // u,
           r2.stride(0) // u, out_TD.stride(0) // u, HAS_W=w_TK is not None, HAS_ROWS2=rows2_ND is not None,
           BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, UNIT=u)
    return out_TD


def combine_reference(rows_ND, pair_row_TK, w_TK=None, rows2_ND=None, out_dtype=None):
    T, K = pair_row_TK.shape
    ok_TK = pair_row_TK >= 0
    v_TKD = rows_ND.float()[pair_row_TK.clamp(min=0).long()]
    if rows2_ND is not None:
        v_TKD = v_TKD + rows2_ND.float()[pair_row_TK.clamp(min=0).long()]
    scale_TK = ok_TK.float() if w_TK is None else torch.where(ok_TK, w_TK.float(), 0.0)
    return (v_TKD * scale_TK[..., None]).sum(1).to(out_dtype or rows_ND.dtype)


def combine(rows_ND, pair_row_TK, w_TK=None, rows2_ND=None, out_dtype=None, impl: str = "triton"):
    fn = combine_triton if impl == "triton" else combine_reference
    return fn(rows_ND, pair_row_TK, w_TK, rows2_ND, out_dtype)

