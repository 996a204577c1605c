"""Stage 3 of FastSparseMoE: gather tokens into the expert-sorted buffer (Optimus Algorithm 1, line 75).

Shapes: T tokens, D model dim, N row capacity (= T*K), R = plan.num_rows valid rows (device scalar).
x_ND[r] = x_TD[row_token_N[r]] for r < R; rows r >= R are left unwritten (their content is unspecified, and every
consumer in this package ignores them). The backward of a gather is a per-token sum over its rows: reduce.combine
with no weights, which needs no atomics and is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2, row_buffer, unit_of


@triton.jit
def _gather_kernel(
    x_ptr, row_token_ptr, out_ptr, num_rows_ptr,  # x [T, D]; row_token int32 [N]; out [N, D]; R int32 []
    D, stride_x, stride_out,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr,
):
    # D and the strides arrive divided by UNIT (_launch.unit_of): rows moved in 16-byte vectors where D is a multiple
    # of 8
    D, stride_x, stride_out = D * UNIT, stride_x * UNIT, stride_out * UNIT
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    R = tl.load(num_rows_ptr)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    tok = tl.load(row_token_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (cols < D)[None, :]
    v = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], v, mask=mask)


def gather_rows_triton(x_TD: torch.Tensor, row_token_N: torch.Tensor, num_rows: torch.Tensor,
                       capacity: int = 0) -> torch.Tensor:
    x_TD = x_TD if x_TD.stride(1) == 1 else x_TD.contiguous()
    N, D = row_token_N.numel(), x_TD.shape[1]
    out_ND = row_buffer(max(N, capacity), D, x_TD.dtype, x_TD.device)
    if N == 0:
        return out_ND
    BLOCK_D = min(next_pow2(D), 512)
    BLOCK_R = max(1, 4096 // BLOCK_D) if x_TD.is_cuda else max(1, 65536 // BLOCK_D)
    grid = (triton.cdiv(N, BLOCK_R), triton.cdiv(D, BLOCK_D))
    u = unit_of(D, x_TD.stride(0), out_ND.stride(0))
    launch(_gather_kernel, grid, x_TD, row_token_N, out_ND, num_rows, D // u, x_TD.stride(0) // u,
           out_ND.stride(0) // u, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, UNIT=u, num_warps=4)
    return out_ND


def gather_rows_reference(x_TD: torch.Tensor, row_token_N: torch.Tensor, num_rows: torch.Tensor,
                          capacity: int = 0) -> torch.Tensor:
    """Same contract; rows >= R are zero here (any value is allowed there)."""
    valid = row_token_N >= 0
    out_ND = torch.where(valid[:, None], x_TD[row_token_N.clamp(min=0).long()], 0).to(x_TD.dtype)
    extra = capacity - out_ND.shape[0]
    return torch.cat([out_ND, out_ND.new_zeros(extra, out_ND.shape[1])]) if extra > 0 else out_ND


def gather_rows(x_TD: torch.Tensor, row_token_N: torch.Tensor, num_rows: torch.Tensor,
                impl: str = "triton", capacity: int = 0) -> torch.Tensor:
    """capacity: the buffer holds max(N, capacity) rows (a GEMM's presented rows: kernels/fp8.py); past N unused."""
    fn = gather_rows_triton if impl == "triton" else gather_rows_reference
    return fn(x_TD, row_token_N, num_rows, capacity)
