"""Stage 1 of FastSparseMoE: token counting (Optimus Algorithm 1, lines 15-43).

Shapes: T tokens, K top-k, P = T*K (token, k) pairs read in flat order p = t*K + k, E local experts (the global
experts [e_start, e_start + E)), B pair blocks (one Triton program each).

Each program counts, for its block of pairs, how many pairs go to each local expert: partial_EB[e, b]. An exclusive
prefix sum over partial_EB read expert-major then gives every (expert, block) the first row it may write in the
expert-sorted buffer, which is what index generation (index_gen.py) needs to place rows without atomics, stably.
Everything stays on the device; no sizes are read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2


@triton.jit
def _count_kernel(
    idx_ptr,  # int [P] global expert of each pair
    partial_ptr,  # int32 [E, B] out: pairs of block b routed to local expert e
    n_pairs, e_start, E, B,
    BLOCK: tl.constexpr, E_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    pairs = b * BLOCK + tl.arange(0, BLOCK)
    in_range = pairs < n_pairs
    e = tl.load(idx_ptr + pairs, mask=in_range, other=0).to(tl.int32) - e_start
    local = in_range & (e >= 0) & (e < E)
    experts = tl.arange(0, E_PAD)
    hit = ((e[:, None] == experts[None, :]) & local[:, None]).to(tl.int32)  # [BLOCK, E_PAD] one-hot
    tl.store(partial_ptr + experts * B + b, tl.sum(hit, axis=0), mask=experts < E)


def pair_block(num_local_experts: int, device: torch.device) -> int:
    """Pairs per program. The one-hot tile is BLOCK x E_PAD, kept at 8K elements on a GPU (registers); the CPU
    interpreter pays per program, so it gets bigger blocks."""
    budget = 8192 if device.type == "cuda" else 65536
    return max(16, min(1024, budget // next_pow2(num_local_experts)))


def count_tokens_triton(idx_TK: torch.Tensor, e_start: int, e_end: int) -> torch.Tensor:
    """partial_EB int32 [E, B]: pairs of block b (pair_block() pairs each) routed to local expert e."""
    E = e_end - e_start
    idx_P = idx_TK.reshape(-1)
    BLOCK = pair_block(E, idx_P.device)
    B = max(1, triton.cdiv(idx_P.numel(), BLOCK))
    partial_EB = torch.empty(E, B, dtype=torch.int32, device=idx_P.device)
    launch(_count_kernel, (B,), idx_P, partial_EB, idx_P.numel(), e_start, E, B, BLOCK=BLOCK, E_PAD=next_pow2(E))
    return partial_EB


def count_tokens_reference(idx_TK: torch.Tensor, e_start: int, e_end: int) -> torch.Tensor:
    E = e_end - e_start
    idx_P = idx_TK.reshape(-1).long() - e_start
    BLOCK = pair_block(E, idx_P.device)
    B = max(1, triton.cdiv(idx_P.numel(), BLOCK))
    local = (idx_P >= 0) & (idx_P < E)
    block_P = torch.arange(idx_P.numel(), device=idx_P.device) // BLOCK
    flat = torch.where(local, idx_P * B + block_P, E * B)  # non-local pairs go to a spill bin, then dropped
    return torch.bincount(flat, minlength=E * B + 1)[: E * B].view(E, B).to(torch.int32)


def count_tokens(idx_TK: torch.Tensor, e_start: int, e_end: int, impl: str = "triton") -> torch.Tensor:
    """Per-block partial counts [E, B]; impl is "triton" or "reference"."""
    fn = count_tokens_triton if impl == "triton" else count_tokens_reference
    return fn(idx_TK, e_start, e_end)


def boundaries(partial_EB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts_E, ends_E, base_EB), all int32 on the device: tokens per expert, inclusive prefix sum (each expert's
    segment end), and the first row of every (expert, block) (exclusive prefix sum read expert-major)."""
    counts_E = partial_EB.sum(dim=1, dtype=torch.int32)
    ends_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    flat = partial_EB.reshape(-1)
    base_EB = (torch.cumsum(flat, 0, dtype=torch.int32) - flat).view_as(partial_EB)
    return counts_E, ends_E, base_EB
