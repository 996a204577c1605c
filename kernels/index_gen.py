"""Stage 2 of FastSparseMoE: index generation (Optimus Algorithm 1, lines 45-72), and the RoutePlan it yields.

Shapes: T tokens, K top-k, pairs p = t*K + k, E local experts [e_start, e_end), N = T*K rows: an upper bound on the
rows of the expert-sorted buffer (the exact count R stays on the device, see RoutePlan.num_rows).

Rows of expert e are offsets_E1[e] .. offsets_E1[e+1]-1, ordered by pair index (stable, hence deterministic sums).
Each program handles one block of pairs: a running one-hot count (cumsum) gives every local pair its rank among the
block's pairs of the same expert; adding the (expert, block) base from token_count.boundaries gives its row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2
from moe_launch.kernels.token_count import boundaries, count_tokens, pair_block


@dataclass(frozen=True)
class RoutePlan:
    """Where every (token, k) pair goes in the expert-sorted buffer. All tensors live on idx_TK's device, int32.

    counts_E     [E]    pairs routed to each local expert
    ends_E       [E]    inclusive prefix sum of counts_E (the `offs` argument of torch._grouped_mm)
    offsets_E1   [E+1]  0 followed by ends_E: rows of expert e are offsets_E1[e] .. offsets_E1[e+1]-1
    row_token_N  [N]    input index: token feeding row r; -1 for r >= num_rows
    row_pair_N   [N]    flat pair t*K+k that row r serves; -1 for r >= num_rows
    pair_row_TK  [T,K]  output index: row holding pair (t, k); -1 if idx_TK[t,k] is not a local expert
    num_rows     []     R = offsets_E1[E], a 0-dim device tensor (reading it with .item() is a host sync)
    N = T*K is a static upper bound on R: buffers are allocated with N rows and kernels skip rows >= R.
    """

    counts_E: torch.Tensor
    ends_E: torch.Tensor
    offsets_E1: torch.Tensor
    row_token_N: torch.Tensor
    row_pair_N: torch.Tensor
    pair_row_TK: torch.Tensor
    num_rows: torch.Tensor
    e_start: int
    e_end: int

    @property
    def num_local_experts(self) -> int:
        return self.e_end - self.e_start

    @property
    def capacity(self) -> int:
        return self.row_token_N.numel()


@triton.jit
def _index_kernel(
    idx_ptr,  # int [P] global expert of each pair
    base_ptr,  # int32 [E, B] first row of (expert, block)
    row_token_ptr, row_pair_ptr,  # int32 [N] out
    pair_row_ptr,  # int32 [P] out
    n_pairs, K, e_start, E, B,
    BLOCK: tl.constexpr, E_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    pairs = b * BLOCK + tl.arange(0, BLOCK)
    in_range = pairs < n_pairs
    e = tl.load(idx_ptr + pairs, mask=in_range, other=0).to(tl.int32) - e_start
    local = in_range & (e >= 0) & (e < E)
    experts = tl.arange(0, E_PAD)
    hit = ((e[:, None] == experts[None, :]) & local[:, None]).to(tl.int32)
    # rank of each pair among earlier pairs of its expert inside this block (0-based; junk for non-local pairs)
    rank = tl.sum(hit * tl.cumsum(hit, axis=0), axis=1) - 1
    base = tl.load(base_ptr + tl.where(local, e, 0) * B + b, mask=local, other=0)
    row = base + rank
    tl.store(row_token_ptr + row, pairs // K, mask=local)
    tl.store(row_pair_ptr + row, pairs, mask=local)
    tl.store(pair_row_ptr + pairs, tl.where(local, row, -1), mask=in_range)


def _plan(counts_E, ends_E, row_token_N, row_pair_N, pair_row_TK, e_start, e_end) -> RoutePlan:
    offsets_E1 = torch.nn.functional.pad(ends_E, (1, 0))
    return RoutePlan(counts_E, ends_E, offsets_E1, row_token_N, row_pair_N, pair_row_TK, offsets_E1[-1],
                     e_start, e_end)


def route_indices_triton(idx_TK: torch.Tensor, e_start: int, e_end: int) -> RoutePlan:
    T, K = idx_TK.shape
    E = e_end - e_start
    idx_P = idx_TK.reshape(-1).contiguous()
    partial_EB = count_tokens(idx_P.view(T, K), e_start, e_end, impl="triton")
    counts_E, ends_E, base_EB = boundaries(partial_EB)
    N = T * K
    row_token_N = torch.full((N,), -1, dtype=torch.int32, device=idx_TK.device)
    row_pair_N = torch.full((N,), -1, dtype=torch.int32, device=idx_TK.device)
    pair_row_P = torch.empty(N, dtype=torch.int32, device=idx_TK.device)
    if N > 0:
        launch(_index_kernel, (partial_EB.shape[1],), idx_P, base_EB, row_token_N, row_pair_N, pair_row_P,
               N, K, e_start, E, partial_EB.shape[1], BLOCK=pair_block(E, idx_P.device), E_PAD=next_pow2(E))
    return _plan(counts_E, ends_E, row_token_N, row_pair_N, pair_row_P.view(T, K), e_start, e_end)


def route_indices_reference(idx_TK: torch.Tensor, e_start: int, e_end: int) -> RoutePlan:
    T, K = idx_TK.shape
    E = e_end - e_start
    dev = idx_TK.device
    e_P = idx_TK.reshape(-1).long() - e_start
    local = (e_P >= 0) & (e_P < E)
    order = torch.argsort(torch.where(local, e_P, E), stable=True)  # local pairs by expert, then by pair index
    counts_E = torch.bincount(e_P[local], minlength=E).to(torch.int32)
    ends_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    R = int(local.sum())  # host sync: fine for a reference
    row_pair_N = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
    row_pair_N[:R] = order[:R].to(torch.int32)
    row_token_N = torch.where(row_pair_N >= 0, row_pair_N // K, -1).to(torch.int32)
    pair_row_P = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
    pair_row_P[order[:R]] = torch.arange(R, dtype=torch.int32, device=dev)
    return _plan(counts_E, ends_E, row_token_N, row_pair_N, pair_row_P.view(T, K), e_start, e_end)


def route_indices(idx_TK: torch.Tensor, e_start: int, e_end: int, impl: str = "triton") -> RoutePlan:
    """Counting + index generation for the local experts [e_start, e_end). impl: "triton" | "reference"."""
    fn = route_indices_triton if impl == "triton" else route_indices_reference
    return fn(idx_TK, e_start, e_end)
