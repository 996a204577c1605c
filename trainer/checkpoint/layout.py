"""Which rank writes which checkpoint file: a pure function of the rank's coordinates and the parallel config.

  model/dense.pt            every non-expert parameter                 rank (dp E mod DP, ep 0)
  model/experts-ep<e>.pt    the expert parameters of EP rank e          rank (dp e mod DP, ep e)
  optim/ep<e>.pt            optimizer state, optimizer_sharding=none   rank (dp e mod DP, ep e) (replicated over DP)
  optim/rank<r>.pt          optimizer shard, zero1 / epso               every rank r
  rng/rank<r>.pt            torch / cuda / python RNG states            every rank r
  trainer.pt                step, data position, layout, config         rank 0

Model-parallel shard m (experts of EP rank m for m < E, the dense part as m = E) is written by DP index m mod DP
(Optimus' DP-scattered writes), so with DP > 1 the write bandwidth of several DP replicas is used at once.
So writes are scattered over ranks (no rank gathers the whole model), and a rank reads back exactly the files of
its own coordinates. A model-only checkpoint (model-step-N) holds just the model/ files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coords:
    rank: int
    dp_rank: int
    ep_rank: int
    ep_size: int
    optimizer_sharding: str  # none | zero1 | epso
    is_moe: bool
    dp_size: int = 1


def shard_writer_dp(shard: int, dp_size: int) -> int:
    """DP index that writes model-parallel shard `shard` (DP-scattered writes)."""
    return shard % dp_size


def model_files(c: Coords) -> dict[str, str]:
    """{relpath: part} this rank READS for the model; part is 'dense' or 'experts'."""
    files = {"model/dense.pt": "dense"}
    if c.is_moe:
        files[f"model/experts-ep{c.ep_rank}.pt"] = "experts"
    return files


def optimizer_file(c: Coords) -> str:
    return f"optim/ep{c.ep_rank}.pt" if c.optimizer_sharding == "none" else f"optim/rank{c.rank}.pt"


def rng_file(c: Coords) -> str:
    return f"rng/rank{c.rank}.pt"


TRAINER_FILE = "trainer.pt"


def writes(c: Coords, model_only: bool = False) -> list[str]:
    """The files this rank WRITES (disjoint across ranks; their union is the whole checkpoint)."""
    out = []
    expert_writer = c.dp_rank == shard_writer_dp(c.ep_rank, c.dp_size)
    dense_writer = c.ep_rank == 0 and c.dp_rank == shard_writer_dp(c.ep_size, c.dp_size)
    for rel, part in model_files(c).items():
        if (part == "experts" and expert_writer) or (part == "dense" and dense_writer):
            out.append(rel)
    if model_only:
        return out
    if c.optimizer_sharding != "none" or expert_writer:
        out.append(optimizer_file(c))
    out.append(rng_file(c))
    if c.rank == 0:
        out.append(TRAINER_FILE)
    return out
