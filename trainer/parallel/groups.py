"""Process groups for data × expert (× pipeline) parallelism, built from one description (`parallel.dp/ep/pp`).

Rank layout (EP innermost, so an EP group sits on consecutive ranks, i.e. inside one node when ep <= GPUs per node,
where the token all-gather / all-to-all is fastest; PP outermost, so stage boundaries cross nodes):

    rank = (pp_rank * dp + dp_rank) * ep + ep_rank

Groups (each rank belongs to exactly one of each):
    ep     same (pp, dp), varying ep_rank   token exchange; expert weights are sharded over it
    dp     same (pp, ep), varying dp_rank   expert-gradient averaging; expert optimizer state shards
    dp_ep  same pp, all dp*ep ranks         non-expert-gradient averaging (EP ranks read different tokens)
    pp     same (dp, ep), varying pp_rank   pipeline stages

`data_rank = dp_rank * ep + ep_rank` out of `data_size = dp * ep`: every rank of a pipeline stage reads a different
slice of the global batch, EP ranks included.

With a world of one process no process group is needed: every group handle is None and the collectives in
`trainer/parallel/comm.py` skip groups of size 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from moe_launch.errors import ConfigError
from moe_launch.trainer.dist import group_timeout


@dataclass(frozen=True)
class Axis:
    """One process group seen from this rank: its handle, the global ranks in it (in group order), this rank's index."""

    group: Optional[Any]  # torch ProcessGroup, or None when the group has one member or there is no process group
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        return self.ranks[index]


@dataclass(frozen=True)
class Groups:
    world_rank: int
    world_size: int
    dp: Axis
    ep: Axis
    pp: Axis
    dp_ep: Axis
    world: Axis

    # the flat names the trainer uses
    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def ep_rank(self) -> int:
        return self.ep.rank

    @property
    def ep_size(self) -> int:
        return self.ep.size

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def pp_size(self) -> int:
        return self.pp.size

    @property
    def dp_group(self) -> Optional[Any]:
        return self.dp.group

    @property
    def ep_group(self) -> Optional[Any]:
        return self.ep.group

    @property
    def pp_group(self) -> Optional[Any]:
        return self.pp.group

    @property
    def dp_ep_group(self) -> Optional[Any]:
        return self.dp_ep.group

    @property
    def data_rank(self) -> int:
        return self.dp.rank * self.ep.size + self.ep.rank

    @property
    def data_size(self) -> int:
        return self.dp.size * self.ep.size


def rank_of(pp_rank: int, dp_rank: int, ep_rank: int, dp: int, ep: int) -> int:
    return (pp_rank * dp + dp_rank) * ep + ep_rank


def coords_of(rank: int, dp: int, ep: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, ep_rank) of a global rank; the inverse of `rank_of`."""
    return rank // (dp * ep), (rank // ep) % dp, rank % ep


def group_ranks(dp: int, ep: int, pp: int) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every kind as tuples of global ranks. Pure; the order is the creation order on all ranks."""
    out: dict[str, list[tuple[int, ...]]] = {"ep": [], "dp": [], "dp_ep": [], "pp": []}
    for p in range(pp):
        for d in range(dp):
            out["ep"].append(tuple(rank_of(p, d, e, dp, ep) for e in range(ep)))
        for e in range(ep):
            out["dp"].append(tuple(rank_of(p, d, e, dp, ep) for d in range(dp)))
        out["dp_ep"].append(tuple(rank_of(p, d, e, dp, ep) for d in range(dp) for e in range(ep)))
    for d in range(dp):
        for e in range(ep):
            out["pp"].append(tuple(rank_of(p, d, e, dp, ep) for p in range(pp)))
    return out


def validate_world(parallel_cfg: Any, world_size: int) -> None:
    p = parallel_cfg
    if p.dp * p.ep * p.pp != world_size:
        raise ConfigError(
            "parallel.dp",
            f"dp*ep*pp = {p.dp}*{p.ep}*{p.pp} = {p.dp * p.ep * p.pp} but {world_size} processes were started",
            "make parallel.dp * parallel.ep * parallel.pp equal the number of trainer processes "
            "(cluster.nodes * cluster.tasks_per_node)",
        )


def build_groups(parallel_cfg: Any) -> Groups:
    """Create the dp / ep / dp_ep / pp groups. Call on every rank after `dist.init_process_group` (or without a
    process group for a single process). Collective: every rank creates every group, in the same order."""
    initialized = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    validate_world(parallel_cfg, world_size)
    dp, ep, pp = parallel_cfg.dp, parallel_cfg.ep, parallel_cfg.pp

    axes: dict[str, Axis] = {}
    for kind, all_ranks in group_ranks(dp, ep, pp).items():
        for ranks in all_ranks:
            # new_group is collective over the world even for groups this rank is not in; size-1 groups need none
            handle = dist.new_group(list(ranks), timeout=group_timeout()) if initialized and len(ranks) > 1 else None
            if rank in ranks:
                axes[kind] = Axis(group=handle, ranks=ranks, rank=ranks.index(rank))
    world_group = dist.group.WORLD if initialized and world_size > 1 else None
    axes["world"] = Axis(group=world_group, ranks=tuple(range(world_size)), rank=rank)
    return Groups(world_rank=rank, world_size=world_size, **axes)
