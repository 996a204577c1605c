"""Optimizer shards saved under one DP size (or sharding strategy) reassembled for another: which saved rank holds
which shard, and the copy. It needs only a way to read the optimizer state dict a given saved rank wrote (resume.py
passes one that reads the file layout.py names).

Optimizer shards live in one coordinate system that does not depend on the layout: the unpadded flat index of a
bucket (trainer/parallel/optimizer.py). A saved shard i of n covers [i*L, (i+1)*L) with L = ceil(numel / n), so any
new shard is assembled from the saved shards that overlap it.

EP and PP sizes must stay the same (the expert buckets' contents depend on which experts a rank holds).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from moe_launch.errors import CheckpointError
from moe_launch.trainer.parallel.groups import rank_of
from moe_launch.trainer.parallel.optimizer import ShardedAdamW

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def shard_of(strategy: str, expert: bool, dp_rank: int, ep_rank: int, dp: int, ep: int) -> tuple[int, int]:
    """(shard index, shard count) of a bucket on the rank at (dp_rank, ep_rank). Mirrors optimizer._axes_for:
    the dp_ep axis orders its members dp-major, so its index is dp_rank * ep + ep_rank."""
    if strategy == "none":
        return 0, 1
    if strategy == "zero1" or expert:
        return dp_rank, dp
    return dp_rank * ep + ep_rank, dp * ep


def holder_of(strategy: str, expert: bool, shard: int, pp_rank: int, ep_rank: int, dp: int, ep: int) -> int:
    """A saved rank holding `shard` of a bucket (expert buckets: of EP rank `ep_rank`)."""
    e = ep_rank if expert else 0  # dense state replicated over EP (zero1, none): read it from EP rank 0
    if strategy == "none":
        return rank_of(pp_rank, 0, e, dp, ep)
    if strategy == "zero1" or expert:
        return rank_of(pp_rank, shard, e, dp, ep)
    return rank_of(pp_rank, shard // ep, shard % ep, dp, ep)


def reshard_optimizer_state(opt: ShardedAdamW, saved_layout: dict[str, Any], read: Callable[[int], dict]) -> None:
    """Fill `opt`'s shards from a checkpoint written with `saved_layout` ({dp, ep, pp, optimizer_sharding}).
    `read(saved_rank)` returns the optimizer state dict that rank saved (ShardedAdamW.state_dict()); only the ranks
    whose shards overlap this rank's are read, each at most once."""
    g = opt.groups
    dp, ep, pp = saved_layout["dp"], saved_layout["ep"], saved_layout.get("pp", 1)
    strategy = saved_layout["optimizer_sharding"]
    if ep != g.ep_size or pp != g.pp_size:
        raise CheckpointError(
            f"the checkpoint was written with ep={ep}, pp={pp}; this run has ep={g.ep_size}, pp={g.pp_size}. "
            "Only parallel.dp (and parallel.optimizer_sharding) may change on resume; keep parallel.ep and "
            "parallel.pp, or start from a model-only checkpoint (model.init_from=ckpt:...)"
        )
    cache: dict[int, dict] = {}

    def saved(rank: int) -> dict:
        if rank not in cache:
            cache[rank] = read(rank)
        return cache[rank]

    step = None
    for b in opt.buckets:
        lo, hi = b.shard_lo, min(b.shard_lo + b.shard_len, b.numel)
        _, count = shard_of(strategy, b.expert, 0, 0, dp, ep)
        width = math.ceil(b.numel / count)
        fresh = {k: torch.zeros_like(getattr(b, k)) for k in STATE_KEYS}  # padding stays zero
        for i in range(lo // width, (hi - 1) // width + 1 if hi > lo else 0):
            a, c = max(lo, i * width), min(hi, (i + 1) * width)
            rank = holder_of(strategy, b.expert, i, g.pp_rank, g.ep_rank, dp, ep)
            sd = saved(rank)
            s = sd["buckets"].get(b.name)
            if s is None or s["param_names"] != b.param_names or s["numel"] != b.numel:
                raise CheckpointError(f"bucket {b.name} of saved rank {rank} does not match this model; "
                                      "resume with the same model.* config")
            if (s["shard_index"], s["shard_count"]) != (i, count):
                raise CheckpointError(f"saved rank {rank} holds shard {s['shard_index']}/{s['shard_count']} of "
                                      f"{b.name}, expected {i}/{count}: the saved layout {saved_layout} is wrong")
            for k in STATE_KEYS:
                fresh[k][a - lo : c - lo] = s[k][a - i * width : c - i * width]
            step = int(sd["step"])
        for k in STATE_KEYS:
            setattr(b, k, fresh[k])
    if step is None:  # this rank's shards are all empty: take the step from any saved rank
        step = int(saved(coords_to_any_rank(g.pp_rank, dp, ep))["step"])
    opt.step_count = step


def coords_to_any_rank(pp_rank: int, dp: int, ep: int) -> int:
    return rank_of(pp_rank, 0, 0, dp, ep)
