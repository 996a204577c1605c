"""Thin collectives over an `Axis` (trainer/parallel/groups.py) that cost nothing on a group of one.

Non-differentiable; the autograd-aware versions for the token exchange live in trainer/parallel/autograd_comm.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_launch.trainer.parallel.groups import Axis

# torch 2.13 renamed the *_tensor collectives to *_single; older torch (e.g. on a GPU image) has only the old names
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_(t: torch.Tensor, axis: Axis, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if axis.size > 1:
        dist.all_reduce(t, op=op, group=axis.group)
    return t


def reduce_scatter(full_N: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sum `full_N` over the axis and return this rank's 1/size chunk (N must be divisible by the axis size)."""
    if axis.size == 1:
        return full_N
    out = torch.empty(full_N.numel() // axis.size, dtype=full_N.dtype, device=full_N.device)
    _reduce_scatter_single(out, full_N.contiguous(), group=axis.group)
    return out


def all_gather(shard_S: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Concatenate every rank's equally sized 1-D shard in axis order."""
    if axis.size == 1:
        return shard_S
    out = torch.empty(shard_S.numel() * axis.size, dtype=shard_S.dtype, device=shard_S.device)
    _all_gather_single(out, shard_S.contiguous(), group=axis.group)
    return out


def all_gather_into_(full_N: torch.Tensor, axis: Axis) -> torch.Tensor:
    """In place: every rank contributes its own 1/size chunk of `full_N` (chunk i at [i*S, (i+1)*S)) and receives
    everyone's. The own chunk is copied out first: gloo does not accept an input that aliases the output."""
    if axis.size > 1:
        s = full_N.numel() // axis.size
        mine = full_N[axis.rank * s : (axis.rank + 1) * s].clone()
        _all_gather_single(full_N, mine, group=axis.group)
    return full_N


def broadcast_(t: torch.Tensor, axis: Axis, src_index: int = 0) -> torch.Tensor:
    """Overwrite `t` on every member with the copy held by the member at index `src_index` of the axis."""
    if axis.size > 1:
        dist.broadcast(t, src=axis.global_rank(src_index), group=axis.group)
    return t


def self_axis(world_rank: int) -> Axis:
    """The trivial axis holding only this rank (no sharding / no reduction)."""
    return Axis(group=None, ranks=(world_rank,), rank=0)
