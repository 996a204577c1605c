"""Differentiable collectives for the EP token exchange, each the adjoint of the other:

    all_gather_rows     forward: concatenate every rank's [N, ...] rows      backward: reduce-scatter the row grads
    reduce_scatter_rows forward: sum [ep*N, ...] over ranks, keep my N rows  backward: all-gather the row grads
    all_to_all_rows     forward: rows to ranks by split sizes               backward: the same exchange reversed

Rows of equal count per rank for the first two (every EP rank runs the same micro-batch shape); variable counts for
all-to-all. On a group of one they are the identity.
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
    @staticmethod
    def forward(ctx, x_N: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return _gather_rows(x_N, axis)

    @staticmethod
    def backward(ctx, g_M: torch.Tensor):
        return _scatter_rows(g_M, ctx.axis), None


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


def all_gather_rows(x_N: torch.Tensor, axis: Axis) -> torch.Tensor:
    if axis.size == 1:
        return x_N
    if not x_N.requires_grad:  # integer routing indices, or inference
        return _gather_rows(x_N, axis)
    return _AllGatherRows.apply(x_N, axis)


def reduce_scatter_rows(x_M: torch.Tensor, axis: Axis) -> torch.Tensor:
    if axis.size == 1:
        return x_M
    return _ReduceScatterRows.apply(x_M, axis)


def all_to_all_rows(x_N: torch.Tensor, out_rows: list[int], in_rows: list[int], axis: Axis) -> torch.Tensor:
    """Send in_rows[j] consecutive rows of x_N to rank j; receive out_rows[j] rows from rank j (in rank order)."""
    if axis.size == 1:
        return x_N
    if not x_N.requires_grad:
        return _exchange_rows(x_N, out_rows, in_rows, axis)
    return _AllToAllRows.apply(x_N, out_rows, in_rows, axis)
