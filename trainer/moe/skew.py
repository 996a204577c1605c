"""Routing-skew guard: the expert stage's worst-case memory is known before anything is allocated, and a stage that
would not fit under train.max_memory_fraction runs in row chunks instead of dying of an out-of-memory error.

Shapes: T tokens of this rank's micro-batch, K top-k, D model dim, F expert hidden, R rows (one (token, slot) pair
each) handed to the experts of this rank.

Where skew costs memory. With the all-gather dispatcher and without expert parallelism the expert stage allocates
its row buffers for every pair it could receive (ep * T * K rows, the FastSparseMoE kernels never size by data), so
a hot expert changes nothing: the worst case is the balanced case. The all-to-all dispatcher receives exactly the
rows other ranks route to its experts, which ranges from 0 to ep * T * K: a hot expert on this rank multiplies its
rows by up to ep.

What the guard does. `rows_budget` turns the memory left under the fraction (after the model and optimizer exist)
into expert rows per MoE layer (`expert_bytes_per_row` counts what every layer keeps for backward plus what one
layer's backward holds). When a call hands the experts more rows than that, `ChunkedExperts` runs them in
chunks of whole rows, each under activation checkpointing: only the chunk's inputs are kept for backward and the F-wide
intermediates of one chunk exist at a time. Rows are independent (one pair per row: each row's output depends on its
own input and expert only), so the result equals the unchunked one up to the rounding of smaller matrix products.
Every chunked call is recorded for the journal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

ExpertsFn = Callable[..., torch.Tensor]


def expert_bytes_per_row(d_model: int, expert_hidden: int, dtype_bytes: int, moe_layers: int) -> int:
    """Activation bytes one row of every MoE layer costs at the peak, the backward of the last layer: each layer
    keeps its rows' input, gate and up products and output for backward (2D + 2F), and the layer in backward also
    holds the output gradient, the input gradients through gate and up (3D), the SwiGLU gradients and the rebuilt
    product (4F). Weights and their gradients are not per row (the optimizer allocates the gradients up front)."""
    return ((2 * d_model + 2 * expert_hidden) * moe_layers + 3 * d_model + 4 * expert_hidden) * dtype_bytes


def worst_case_rows(tokens: int, top_k: int, ep: int, dispatcher: str) -> int:
    """The most rows the expert stage of one layer can be handed for a micro-batch of `tokens` tokens per rank."""
    del dispatcher  # all-gather: always this many (static buffers); all-to-all: this many when all route here
    return ep * tokens * top_k


def balanced_rows(tokens: int, top_k: int, ep: int, dispatcher: str) -> int:
    """Rows of a perfectly balanced step: what the stage is sized for unless routing is skewed."""
    return ep * tokens * top_k if dispatcher == "allgather" else tokens * top_k


def rows_budget(free_bytes: int, bytes_per_row: int) -> int:
    """Expert rows per layer that fit in `free_bytes`. At least 1: a budget that cannot hold a single row still makes
    progress, one row at a time."""
    return max(1, free_bytes // max(1, bytes_per_row))


def free_memory_bytes(device: torch.device, fraction: float) -> int:
    """The part of `fraction` of the device's memory not yet allocated (CPU: of the machine's RAM, minus this
    process's resident size)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.memory_allocated(device)
    else:
        import psutil

        total, used = psutil.virtual_memory().total, psutil.Process().memory_info().rss
    return max(0, int(fraction * total) - used)


@dataclass
class ChunkedExperts:
    """An experts_fn (same signature) that splits calls above `max_rows` rows into checkpointed chunks."""

    inner: ExpertsFn
    max_rows: int
    events: list[tuple[int, int]] = field(default_factory=list)  # (rows, chunks) of every chunked call

    def __call__(self, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor, *weights: torch.Tensor,
                 e_start: int = 0) -> torch.Tensor:
        N, K = idx_NK.shape
        per_chunk = max(1, self.max_rows // K)  # tokens per chunk: whole tokens, so no output row is split
        if N <= per_chunk:
            return self.inner(x_ND, idx_NK, w_NK, *weights, e_start=e_start)
        self.events.append((N * K, -(-N // per_chunk)))
        outs = []
        for lo in range(0, N, per_chunk):
            hi = min(N, lo + per_chunk)
            outs.append(checkpoint(self._call, x_ND[lo:hi], idx_NK[lo:hi], w_NK[lo:hi], *weights, e_start,
                                   use_reentrant=False))
        return torch.cat(outs)

    def _call(self, x_ND, idx_NK, w_NK, *rest):
        *weights, e_start = rest
        return self.inner(x_ND, idx_NK, w_NK, *weights, e_start=e_start)

    def drain(self) -> list[tuple[int, int]]:
        out, self.events = self.events, []
        return out


def install_skew_guard(layers: list, max_rows: int) -> list[ChunkedExperts]:
    """Wrap the experts_fn of every MoE layer; returns the guards (their events feed the journal)."""
    guards = []
    for layer in layers:
        guard = ChunkedExperts(layer.experts_fn, max_rows)
        layer.experts_fn = guard
        guards.append(guard)
    return guards


def load_alerts(counts_LE: torch.Tensor, threshold: float) -> list[tuple[int, float]]:
    """(layer, max/mean load) of every layer above `threshold` (0: no alerts). counts_LE: the global step loads."""
    if threshold <= 0:
        return []
    c = counts_LE.double()
    ratio_L = c.max(dim=1).values / c.mean(dim=1).clamp(min=1e-9)
    return [(i, float(r)) for i, r in enumerate(ratio_L.tolist()) if r > threshold]


def newly_above(alerts: list[tuple[int, float]], above: set[int]) -> tuple[list[tuple[int, float]], set[int]]:
    """Edge-triggered alerts (a collapsed layer would otherwise fill the journal at every log step): the layers that
    crossed the threshold since the last check, and the set of layers above it now."""
    return [(i, r) for i, r in alerts if i not in above], {i for i, _ in alerts}
