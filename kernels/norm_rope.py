"""QK-norm and RoPE of one attention projection in one kernel, forward and backward.

Shapes: N tokens (B sequences of S, row n at position n % S), D = H * Dh the projection's width, Dh head dim,
P = Dh / 2 rotation pairs (dim i pairs with i + P inside each head, the "rotate half" layout of trainer/model/rope.py).

    y_ND, rstd_N = norm_rope_fwd(x_ND, w_D, eps, cos_SDh, sin_signed_SDh, S)
    y = rope(rmsnorm(x) * w)          rmsnorm over the full row (OLMoE normalises q and k over all heads at once)
    gx_ND, gw_D = norm_rope_bwd(g_ND, x_ND, w_D, rstd_N, cos_SDh, sin_signed_SDh, S)

The reference is the model's own path (trainer/model/attention.py without the fusion): RMSNorm, a cast to the
activation dtype, then apply_rotary. Here the normalised row stays in fp32 into the rotation (one rounding, at the
end, instead of two). Each element's rotation partner (i +- P) is loaded a second time, from L1, so the tile needs no
shuffles; the fp32 tables are [S, Dh] and every head of a row reads the same Dh entries, also from L1.

Why a kernel: Inductor fuses the forward into one pass, but splits the backward into a reduction pass (the weight
gradient over tokens, and each row's sum for the norm's gradient) and a second element-wise pass that reads x and g
again. Here each program walks a strip of rows once: the input gradient row by row, the weight gradient kept in
registers and written as one fp32 partial per program, summed afterwards (deterministic: a fixed strip per program).

Backward math (fp32): gy = rope^-1(g) = g * cos - swap(g) * sin_signed; xh = x * rstd;
gx = rstd * (w * gy - xh * mean(xh * w * gy)); gw = sum over rows of gy * xh.

`norm_rope` is the differentiable entry point, a torch custom op: torch.compile keeps it as one opaque call in the
compiled attention graph (an autograd.Function would be traced into it, and Inductor would split it again).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2, sm_count, unit_of

_TILE_ELEMS = 4096  # elements of x per tile: whole rows, two of them at OLMoE's D = 2048
_STRIPS_PER_SM = 4  # backward programs per SM: enough rows in flight to keep HBM busy, few weight-gradient partials


@triton.jit
def _rope_tile(v, v_partner, rows, cols, cos_ptr, sin_ptr, S, HEAD_DIM: tl.constexpr, SIGN: tl.constexpr, mask):
    """v * cos + SIGN * v_partner * sin_signed at each element's position (row % S) and head dim (col % Dh)."""
    t = (rows % S)[:, None] * HEAD_DIM + (cols % HEAD_DIM)[None, :]
    cos = tl.load(cos_ptr + t, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + t, mask=mask, other=0.0)
    return v * cos + SIGN * v_partner * sin


@triton.jit
def _partner(cols, HEAD_DIM: tl.constexpr):
    half: tl.constexpr = HEAD_DIM // 2
    return tl.where(cols % HEAD_DIM < half, cols + half, cols - half)


@triton.jit
def _norm_rope_fwd_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr,  # x [N, D] (row stride stride_x); w [D]; y [N, D]; rstd fp32 [N]
    N, D, S, stride_x, eps,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr,
):
    D, stride_x = D * UNIT, stride_x * UNIT  # passed divided by UNIT (_launch.unit_of): 16-byte vectors
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    partner = _partner(cols, HEAD_DIM)
    row_ok = rows < N
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=col_ok, other=0.0).to(tl.float32)
    y = _rope_tile(x * w[None, :], xp * wp[None, :], rows, cols, cos_ptr, sin_ptr, S, HEAD_DIM, 1.0, mask)
    y = y * rstd[:, None]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _norm_rope_bwd_kernel(
    g_ptr, x_ptr, w_ptr, rstd_ptr, cos_ptr, sin_ptr, gx_ptr, gw_part_ptr,  # g, gx [N, D]; gw_part fp32 [programs, D]
    N, D, S, stride_g, stride_x, rows_per_program,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr,
):
    D, stride_g, stride_x = D * UNIT, stride_g * UNIT, stride_x * UNIT  # as in the forward
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    partner = _partner(cols, HEAD_DIM)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    gw = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    row0 = pid * rows_per_program
    row_end = tl.minimum(row0 + rows_per_program, N)
    for r0 in range(row0, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gp = tl.load(g_ptr + r64 * stride_g + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        gy = _rope_tile(g, gp, rows, cols, cos_ptr, sin_ptr, S, HEAD_DIM, -1.0, mask)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xh = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        wgy = w[None, :] * gy
        c = tl.sum(xh * wgy, axis=1) / D
        gx = rstd[:, None] * (wgy - xh * c[:, None])
        tl.store(gx_ptr + r64 * D + cols[None, :], gx.to(gx_ptr.dtype.element_ty), mask=mask)
        gw += gy * xh
    tl.store(gw_part_ptr + pid.to(tl.int64) * D + cols, tl.sum(gw, axis=0), mask=col_ok)


def _rows(t_BSD: torch.Tensor) -> torch.Tensor:
    """[B, S, D] as [B * S, D] rows with a unit last stride, without a copy where the layout allows (a slice of a
    fused projection's output keeps its row stride)."""
    if t_BSD.stride(-1) != 1 or t_BSD.stride(0) != t_BSD.shape[1] * t_BSD.stride(1):
        t_BSD = t_BSD.contiguous()
    return t_BSD.as_strided((t_BSD.shape[0] * t_BSD.shape[1], t_BSD.shape[2]), (t_BSD.stride(1), 1))


def _tiles(D: int, head_dim: int) -> tuple[int, int]:
    if head_dim % 2:
        raise ValueError(f"norm_rope: head dim {head_dim} is odd (RoPE rotates pairs)")
    BLOCK_D = next_pow2(D)
    return max(1, _TILE_ELEMS // BLOCK_D), BLOCK_D


def _programs(N: int, BLOCK_R: int, device: torch.device) -> int:
    wanted = sm_count(device) * _STRIPS_PER_SM if device.type == "cuda" else 4  # the interpreter: a few strips
    return min(wanted, triton.cdiv(N, BLOCK_R))


def norm_rope_fwd(x_BSD: torch.Tensor, w_D: torch.Tensor, eps: float, cos_SDh: torch.Tensor,
                  sin_signed_SDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y [B, S, D] contiguous in x's dtype, and the rows' rstd (fp32 [B * S]) for the backward."""
    B, S, D = x_BSD.shape
    Dh = cos_SDh.shape[-1]
    x_ND = _rows(x_BSD)
    N = B * S
    y_BSD = torch.empty(B, S, D, dtype=x_BSD.dtype, device=x_BSD.device)
    rstd_N = torch.empty(N, dtype=torch.float32, device=x_BSD.device)
    if N == 0:
        return y_BSD, rstd_N
    BLOCK_R, BLOCK_D = _tiles(D, Dh)
    u = unit_of(D, x_ND.stride(0))
    launch(_norm_rope_fwd_kernel, (triton.cdiv(N, BLOCK_R),), x_ND, w_D, cos_SDh, sin_signed_SDh, y_BSD, rstd_N,
           N, D // u, S, x_ND.stride(0) // u, eps, HEAD_DIM=Dh, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, UNIT=u,
           num_warps=8 if BLOCK_D * BLOCK_R >= 4096 else 4)
    return y_BSD, rstd_N


def norm_rope_bwd(g_BSD: torch.Tensor, x_BSD: torch.Tensor, w_D: torch.Tensor, rstd_N: torch.Tensor,
                  cos_SDh: torch.Tensor, sin_signed_SDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gx [B, S, D] contiguous in x's dtype, gw [D] in w's dtype."""
    B, S, D = x_BSD.shape
    Dh = cos_SDh.shape[-1]
    x_ND, g_ND = _rows(x_BSD), _rows(g_BSD)
    N = B * S
    gx_BSD = torch.empty(B, S, D, dtype=x_BSD.dtype, device=x_BSD.device)
    if N == 0:
        return gx_BSD, torch.zeros_like(w_D)
    BLOCK_R, BLOCK_D = _tiles(D, Dh)
    programs = _programs(N, BLOCK_R, x_BSD.device)
    # whole tiles per program, so only the last program's strip ends inside a tile
    rows_per_program = triton.cdiv(triton.cdiv(N, programs), BLOCK_R) * BLOCK_R
    programs = triton.cdiv(N, rows_per_program)
    gw_part = torch.empty(programs, D, dtype=torch.float32, device=x_BSD.device)
    u = unit_of(D, x_ND.stride(0), g_ND.stride(0))
    launch(_norm_rope_bwd_kernel, (programs,), g_ND, x_ND, w_D, rstd_N, cos_SDh, sin_signed_SDh, gx_BSD, gw_part,
           N, D // u, S, g_ND.stride(0) // u, x_ND.stride(0) // u, rows_per_program,
           HEAD_DIM=Dh, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, UNIT=u, num_warps=8 if BLOCK_D * BLOCK_R >= 4096 else 4)
    return gx_BSD, gw_part.sum(0).to(w_D.dtype)


@torch.library.custom_op("moe_launch::norm_rope", mutates_args=())
def _norm_rope_op(x_BSD: torch.Tensor, w_D: torch.Tensor, cos_SDh: torch.Tensor, sin_signed_SDh: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_rope_fwd(x_BSD, w_D, eps, cos_SDh, sin_signed_SDh)


@_norm_rope_op.register_fake
def _(x_BSD, w_D, cos_SDh, sin_signed_SDh, eps):
    B, S, D = x_BSD.shape
    return x_BSD.new_empty(B, S, D), x_BSD.new_empty(B * S, dtype=torch.float32)


@torch.library.custom_op("moe_launch::norm_rope_bwd", mutates_args=())
def _norm_rope_bwd_op(g_BSD: torch.Tensor, x_BSD: torch.Tensor, w_D: torch.Tensor, rstd_N: torch.Tensor,
                      cos_SDh: torch.Tensor, sin_signed_SDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_rope_bwd(g_BSD, x_BSD, w_D, rstd_N, cos_SDh, sin_signed_SDh)


@_norm_rope_bwd_op.register_fake
def _(g_BSD, x_BSD, w_D, rstd_N, cos_SDh, sin_signed_SDh):
    B, S, D = x_BSD.shape
    return x_BSD.new_empty(B, S, D), torch.empty_like(w_D)


def _setup_context(ctx, inputs, output) -> None:
    x_BSD, w_D, cos_SDh, sin_signed_SDh, _eps = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x_BSD, w_D, output[1], cos_SDh, sin_signed_SDh)


def _backward(ctx, g_BSD, _g_rstd):
    x_BSD, w_D, rstd_N, cos_SDh, sin_signed_SDh = ctx.saved_tensors
    gx_BSD, gw_D = _norm_rope_bwd_op(g_BSD, x_BSD, w_D, rstd_N, cos_SDh, sin_signed_SDh)
    return gx_BSD, gw_D, None, None, None


_norm_rope_op.register_autograd(_backward, setup_context=_setup_context)


def norm_rope(x_BSD: torch.Tensor, w_D: torch.Tensor, eps: float, cos_SDh: torch.Tensor,
              sin_signed_SDh: torch.Tensor) -> torch.Tensor:
    """rope(rmsnorm(x) * w) over [B, S, D] (D = heads x head dim), differentiable in x and w; the tables are the
    first S rows of trainer/model/rope.py's Rotary buffers (fp32, contiguous)."""
    return _norm_rope_op(x_BSD, w_D, cos_SDh, sin_signed_SDh, eps)[0]
