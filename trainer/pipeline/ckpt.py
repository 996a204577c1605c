"""Checkpoint files of a pipelined model: every stage writes its own shards, the writes scattered over DP ranks.

Same directory protocol as trainer/checkpoint (store.write_checkpoint: atomic, sha256 manifest written last), with
the stage in the file names (trainer/checkpoint/layout.py has no pp coordinate):

    model/pp<p>/dense.pt            stage p's non-expert parameters           written by (pp p, dp w(m), ep 0)
    model/pp<p>/experts-ep<e>.pt    stage p's experts of EP rank e            written by (pp p, dp w(m), ep e)
    optim/pp<p>-ep<e>.pt            optimizer, optimizer_sharding=none        written by (pp p, dp 0, ep e)
    optim/rank<r>.pt                optimizer shard, zero1 / epso             every rank r
    rng/rank<r>.pt, trainer.pt      as trainer/checkpoint/layout.py           every rank / rank 0

DP-scattered model writes (Optimus, trainer/parallel/reshard.model_shard_writer): the model shards of the whole
pipeline are numbered m = p * (1 + ep) + (0 for dense, 1 + e for experts of EP rank e); shard m is written by DP
rank m mod dp. So with dp > 1 the stages' shards land on different DP ranks (nodes) instead of all on dp rank 0.

Parameter names inside the files are the full model's, so a model-only checkpoint written under one PP layout
loads into any other (`load_stage_model` reads the other stages' files when its own do not hold its names).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from moe_launch.errors import CheckpointError
from moe_launch.trainer.checkpoint.state import FileNames, save_files
from moe_launch.trainer.checkpoint.store import load_file, read_manifest
from moe_launch.trainer.dist import Comm
from moe_launch.trainer.parallel.groups import Groups
from moe_launch.trainer.parallel.reshard import model_shard_writer

TRAINER_FILE = "trainer.pt"


@dataclass(frozen=True)
class StageCoords:
    rank: int
    pp_rank: int
    dp_rank: int
    dp_size: int
    ep_rank: int
    ep_size: int
    optimizer_sharding: str
    is_moe: bool

    @classmethod
    def of(cls, groups: Groups, optimizer_sharding: str, is_moe: bool) -> "StageCoords":
        return cls(groups.world_rank, groups.pp_rank, groups.dp_rank, groups.dp_size, groups.ep_rank,
                   groups.ep_size, optimizer_sharding, is_moe)


def model_files(c: StageCoords, pp_rank: Optional[int] = None) -> dict[str, str]:
    """{relpath: part} of stage `pp_rank` (default: this rank's) for this rank's EP coordinate."""
    p = c.pp_rank if pp_rank is None else pp_rank
    files = {f"model/pp{p}/dense.pt": "dense"}
    if c.is_moe:
        files[f"model/pp{p}/experts-ep{c.ep_rank}.pt"] = "experts"
    return files


def model_writer_dp(c: StageCoords, part: str) -> int:
    """The DP rank that writes this stage's `part` shard (for this rank's EP coordinate)."""
    m = c.pp_rank * (1 + c.ep_size) + (0 if part == "dense" else 1 + c.ep_rank)
    return model_shard_writer(m, c.dp_size)


def optimizer_file(c: StageCoords) -> str:
    return f"optim/pp{c.pp_rank}-ep{c.ep_rank}.pt" if c.optimizer_sharding == "none" else f"optim/rank{c.rank}.pt"


def rng_file(c: StageCoords) -> str:
    return f"rng/rank{c.rank}.pt"


def writes(c: StageCoords, model_only: bool = False) -> list[str]:
    """The files this rank WRITES: disjoint across ranks, their union is the whole checkpoint."""
    out = [rel for rel, part in model_files(c).items()
           if c.dp_rank == model_writer_dp(c, part) and (part == "experts" or c.ep_rank == 0)]
    if model_only:
        return out
    if c.optimizer_sharding != "none" or c.dp_rank == 0:
        out.append(optimizer_file(c))
    out.append(rng_file(c))
    if c.rank == 0:
        out.append(TRAINER_FILE)
    return out


def file_names(c: StageCoords) -> FileNames:
    return FileNames(model_files(c), optimizer_file(c), rng_file(c))


def save(ckpt_dir: Path, step: int, c: StageCoords, model: nn.Module, optimizer: Any, trainer_state: dict,
         comm: Comm, device: torch.device, model_only: bool = False, meta: Optional[dict] = None,
         after_shards: Optional[Callable[[], None]] = None) -> Path:
    """Synchronous save, collective over `comm` (the world): each rank writes its files of `writes(c)`."""
    return save_files(Path(ckpt_dir), step, writes(c, model_only), file_names(c), model, optimizer, trainer_state,
                      comm, device, meta=meta, after_shards=after_shards)


def load_stage_model(ckpt_dir: Path, c: StageCoords, model: nn.Module) -> None:
    """Load this stage's parameters. Reads its own stage's files when they hold every name (same PP layout);
    otherwise every stage's files of this EP coordinate (a checkpoint written under another PP split)."""
    want = set(model.state_dict())
    sd: dict[str, torch.Tensor] = {}
    for rel in model_files(c):
        if (Path(ckpt_dir) / rel).is_file():
            sd.update(load_file(ckpt_dir, rel))
    if not want <= set(sd):
        manifest = read_manifest(Path(ckpt_dir)) or {"files": {}}
        stages = sorted({int(m.group(1)) for rel in manifest["files"] if (m := re.match(r"model/pp(\d+)/", rel))})
        if not stages and any(rel.startswith("model/") for rel in manifest["files"]):
            # an unpipelined checkpoint of trainer/checkpoint: model/dense.pt + model/experts-ep<e>.pt
            rels = ["model/dense.pt"] + ([f"model/experts-ep{c.ep_rank}.pt"] if c.is_moe else [])
        else:
            rels = [rel for p in stages for rel in model_files(c, p)]
        sd = {}
        for rel in rels:
            sd.update({k: v for k, v in load_file(ckpt_dir, rel).items() if k in want})
    missing = sorted(want - set(sd))
    if missing:
        raise CheckpointError(f"{ckpt_dir}: parameters {missing[:4]} of this stage are in no model file; use the "
                              "same model.* config (and parallel.ep) as the run that wrote it")
    model.load_state_dict({k: v for k, v in sd.items() if k in want}, strict=True)


def load_optimizer(ckpt_dir: Path, c: StageCoords, optimizer: Any) -> None:
    optimizer.load_state_dict(load_file(ckpt_dir, optimizer_file(c)))
