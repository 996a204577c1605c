"""Which rank writes which checkpoint file: a pure function of the rank's coordinates (pipeline stage p, DP rank,
EP rank e) and the parallel sizes. With one stage (pp=1) the stage part `pp<p>/` / `pp<p>-` is left out of the names.

  model/pp<p>/dense.pt            stage p's non-expert parameters        rank (p, dp w(p, E), ep 0)
  model/pp<p>/experts-ep<e>.pt    stage p's experts of EP rank e          rank (p, dp w(p, e), ep e)
  optim/pp<p>-ep<e>.pt            optimizer, optimizer_sharding=none      rank (p, dp w(p, e), ep e); replicated over DP
  optim/rank<r>.pt                optimizer shard, zero1 / epso           every rank r
  rng/rank<r>.pt                  torch / cuda / python RNG states        every rank r
  trainer.pt                      step, data position, layout, config     rank 0

DP-scattered writes (Optimus): the model shards of the whole pipeline are numbered m = p * (E + 1) + (e for the
experts of EP rank e, E for the dense part), and shard m is written by DP rank w = m mod DP; so with DP > 1 the
write bandwidth of several DP replicas is used at once and no rank gathers the whole model. The replicated optimizer
file of (p, e) goes with its expert shard. A rank reads back exactly the files of its own coordinates (resume.py
reads others' when the layout changed). Parameter names inside the model files are the full model's, so a model-only
checkpoint (model-step-N, the model/ files only) loads into any PP layout (state.load_model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Coords:
    rank: int
    dp_rank: int
    ep_rank: int
    ep_size: int
    optimizer_sharding: str  # none | zero1 | epso
    is_moe: bool
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @classmethod
    def of(cls, groups: Any, optimizer_sharding: str, is_moe: bool) -> "Coords":
        return cls(rank=groups.world_rank, dp_rank=groups.dp_rank, ep_rank=groups.ep_rank, ep_size=groups.ep_size,
                   optimizer_sharding=optimizer_sharding, is_moe=is_moe, dp_size=groups.dp_size,
                   pp_rank=groups.pp_rank, pp_size=groups.pp_size)


def model_shard_writer(m: int, dp_size: int) -> int:
    """DP index that writes model-parallel shard `m` (DP-scattered writes)."""
    return m % dp_size


def writer_dp(c: Coords, part: str) -> int:
    """The DP rank that writes stage c.pp_rank's `part` ('dense' or 'experts' of c.ep_rank)."""
    m = c.pp_rank * (c.ep_size + 1) + (c.ep_size if part == "dense" else c.ep_rank)
    return model_shard_writer(m, c.dp_size)


def _stage_dir(c: Coords, pp_rank: int) -> str:
    return "" if c.pp_size == 1 else f"pp{pp_rank}/"


def model_files(c: Coords, pp_rank: Optional[int] = None) -> dict[str, str]:
    """{relpath: part} of stage `pp_rank` (default: this rank's) for this rank's EP coordinate; part is 'dense' or
    'experts'."""
    stage = _stage_dir(c, c.pp_rank if pp_rank is None else pp_rank)
    files = {f"model/{stage}dense.pt": "dense"}
    if c.is_moe:
        files[f"model/{stage}experts-ep{c.ep_rank}.pt"] = "experts"
    return files


def optimizer_file(c: Coords) -> str:
    if c.optimizer_sharding != "none":
        return f"optim/rank{c.rank}.pt"
    return f"optim/ep{c.ep_rank}.pt" if c.pp_size == 1 else f"optim/pp{c.pp_rank}-ep{c.ep_rank}.pt"


def rng_file(c: Coords) -> str:
    return f"rng/rank{c.rank}.pt"


TRAINER_FILE = "trainer.pt"


def writes(c: Coords, model_only: bool = False) -> list[str]:
    """The files this rank WRITES (disjoint across ranks; their union is the whole checkpoint)."""
    expert_writer = c.dp_rank == writer_dp(c, "experts")
    out = []
    for rel, part in model_files(c).items():
        if (part == "experts" and expert_writer) or (part == "dense" and c.ep_rank == 0
                                                     and c.dp_rank == writer_dp(c, "dense")):
            out.append(rel)
    if model_only:
        return out
    if c.optimizer_sharding != "none" or expert_writer:
        out.append(optimizer_file(c))
    out.append(rng_file(c))
    if c.rank == 0:
        out.append(TRAINER_FILE)
    return out
