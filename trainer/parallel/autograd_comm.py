"""Differentiable collectives for the EP token exchange, each the adjoint of the other:

    all_gather_rows     forward: concatenate every rank's [N, ...] rows      backward: reduce-scatter the row grads
    reduce_scatter_rows forward: sum [ep*N, ...] over ranks, keep my N rows  backward: all-gather the row grads
    all_to_all_rows     forward: rows to ranks by split sizes               backward: the same exchange reversed

Rows of equal count per rank for the first two (every EP rank runs the same micro-batch shape); variable counts for
all-to-all. On a group of one they are the identity.

Every rank must issue the same collectives in the same order, in forward AND backward, or the group deadlocks.
Hence: tensors whose gradients are reduced together are gathered by one autograd node; a gradient missing on one
rank is sent as zeros; and a rank whose experts received no tokens keeps its output attached to the exchanged
inputs (`keep_in_graph`), so that its backward still joins the reverse collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_launch.trainer.parallel.comm import all_gather, reduce_scatter
from moe_launch.trainer.parallel.groups import Axis


def _gather_rows(x_N: torch.Tensor, axis: Axis) -> torch.Tensor:
    return all_gather(x_N.contiguous().reshape(-1), axis).view(axis.size * x_N.shape[0], *x_N.shape[1:])


def _scatter_rows(x_M: torch.Tensor, axis: Axis) -> torch.Tensor:
    return reduce_scatter(x_M.contiguous().reshape(-1), axis).view(x_M.shape[0] // axis.size, *x_M.shape[1:])


def _exchange_rows(x_N: torch.Tensor, out_rows: list[int], in_rows: list[int], axis: Axis) -> torch.Tensor:
    out = x_N.new_empty((sum(out_rows), *x_N.shape[1:]))
    dist.all_to_all_single(out, x_N.contiguous(), output_split_sizes=out_rows, input_split_sizes=in_rows,
                           group=axis.group)
    return out


class _AllGatherRows(torch.autograd.Function):
    """Gathers several tensors in one autograd node, so that their backward reduce-scatters run in one fixed order
    on every rank (two separate nodes could be scheduled in different orders on different ranks: a deadlock)."""

    @staticmethod
    def forward(ctx, axis: Axis, *xs_N: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.axis = axis
        ctx.shapes = [(axis.size * x.shape[0], *x.shape[1:]) for x in xs_N]
        ctx.dtypes = [(x.dtype, x.device) for x in xs_N]
        return tuple(_gather_rows(x, axis) for x in xs_N)

    @staticmethod
    def backward(ctx, *gs_M: torch.Tensor):
        # a missing gradient still takes part in the collective (as zeros): every rank must call the same ones
        grads = []
        for g, shape, (dtype, device) in zip(gs_M, ctx.shapes, ctx.dtypes):
            g = torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            grads.append(_scatter_rows(g, ctx.axis))
        return (None, *grads)


class _Anchor(torch.autograd.Function):
    """Identity on y that also routes a zero gradient to `anchors`. Used when a rank computed nothing from its
    received tokens (no local pairs): its backward must still join the collectives that produced them."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.anchor_meta = [(a.shape, a.dtype, a.device) for a in anchors]
        return y.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return (g, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.anchor_meta))


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_M: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return _scatter_rows(x_M, axis)

    @staticmethod
    def backward(ctx, g_N: torch.Tensor):
        return _gather_rows(g_N, ctx.axis), None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_N: torch.Tensor, out_rows: list[int], in_rows: list[int], axis: Axis) -> torch.Tensor:
        ctx.out_rows, ctx.in_rows, ctx.axis = out_rows, in_rows, axis
        return _exchange_rows(x_N, out_rows, in_rows, axis)

    @staticmethod
    def backward(ctx, g_M: torch.Tensor):
        return _exchange_rows(g_M, ctx.in_rows, ctx.out_rows, ctx.axis), None, None, None


def all_gather_rows(axis: Axis, *xs_N: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gather each tensor's rows over the axis. Differentiable (as one node) when grad mode is on and any input
    requires grad; integer tensors (routing indices) should be gathered in a separate call."""
    if axis.size == 1:
        return xs_N
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs_N):
        return _AllGatherRows.apply(axis, *xs_N)
    return tuple(_gather_rows(x, axis) for x in xs_N)


def keep_in_graph(y: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
    """y, made to depend on `anchors` when it does not already (so backward reaches the anchors' collectives)."""
    if y.requires_grad or not torch.is_grad_enabled() or not any(a.requires_grad for a in anchors):
        return y
    return _Anchor.apply(y, *anchors)


def reduce_scatter_rows(x_M: torch.Tensor, axis: Axis) -> torch.Tensor:
    if axis.size == 1:
        return x_M
    if not (torch.is_grad_enabled() and x_M.requires_grad):
        return _scatter_rows(x_M, axis)
    return _ReduceScatterRows.apply(x_M, axis)


def all_to_all_rows(x_N: torch.Tensor, out_rows: list[int], in_rows: list[int], axis: Axis) -> torch.Tensor:
    """Send in_rows[j] consecutive rows of x_N to rank j; receive out_rows[j] rows from rank j (in rank order)."""
    if axis.size == 1:
        return x_N
    if not (torch.is_grad_enabled() and x_N.requires_grad):
        return _exchange_rows(x_N, out_rows, in_rows, axis)
    return _AllToAllRows.apply(x_N, out_rows, in_rows, axis)
