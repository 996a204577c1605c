"""Whole-model state from EP-sharded pieces, and back: what export needs and what `init_from=ckpt:` reads.

A checkpoint (trainer/checkpoint/layout.py) keeps the non-expert parameters once (model/dense.pt) and the experts
of EP rank e in model/experts-ep<e>.pt, whatever the DP size; so concatenating the expert files in EP order gives
the full model for any DP x EP layout the run used. A live EP group can do the same with one all-gather per
expert tensor (`gather_full_state`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.errors import CheckpointError
from moe_launch.trainer.checkpoint import layout
from moe_launch.trainer.checkpoint.store import load_file, read_manifest, verify, write_checkpoint
from moe_launch.trainer.dist import Comm

_EXPERT_FILE = re.compile(r"model/experts-ep(\d+)\.pt$")


def is_expert_param(name: str) -> bool:
    """Expert tensors are the stacked [E_local, ...] ones of an MoE layer (the trainer marks them `_moe_expert`)."""
    return name.rsplit(".", 1)[-1] in ("w_gate_EFD", "w_up_EFD", "w_down_EDF")


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Inverse of dataclasses.asdict(ModelConfig), tolerant of keys a newer/older schema added or dropped."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    moe_names = {f.name for f in dataclasses.fields(MoEConfig)}
    moe = MoEConfig(**{k: v for k, v in (d.get("moe") or {}).items() if k in moe_names})
    return ModelConfig(**{k: v for k, v in d.items() if k in names and k != "moe"}, moe=moe)


def checkpoint_model_config(ckpt_dir: Path) -> Optional[ModelConfig]:
    """The model config a checkpoint was written with: manifest meta (model-only) or trainer.pt (full slots)."""
    manifest = read_manifest(ckpt_dir) or {}
    d = (manifest.get("meta") or {}).get("model")
    if d is None and layout.TRAINER_FILE in manifest.get("files", {}):
        d = load_file(ckpt_dir, layout.TRAINER_FILE).get("model")
    return model_config_from_dict(d) if d else None


def full_state_from_checkpoint(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], Optional[ModelConfig]]:
    """(full state dict with every expert, model config if recorded) from a verified checkpoint directory."""
    ckpt_dir = Path(str(ckpt_dir).removeprefix("ckpt:")).expanduser()
    ok, reason = verify(ckpt_dir)
    if not ok:
        raise CheckpointError(f"{reason}; export from a complete checkpoint (ckpt-a, ckpt-b or model-step-N)")
    files = read_manifest(ckpt_dir)["files"]
    state: dict[str, torch.Tensor] = dict(load_file(ckpt_dir, "model/dense.pt"))
    expert_files = sorted((int(m.group(1)), rel) for rel in files if (m := _EXPERT_FILE.match(rel)))
    if [e for e, _ in expert_files] != list(range(len(expert_files))):
        raise CheckpointError(f"{ckpt_dir}: expert files {[rel for _, rel in expert_files]} are not ep0..epN-1; "
                              "the checkpoint is incomplete")
    shards = [load_file(ckpt_dir, rel) for _, rel in expert_files]
    for name in shards[0] if shards else ():
        state[name] = torch.cat([s[name] for s in shards], dim=0)
    return state, checkpoint_model_config(ckpt_dir)


@torch.no_grad()
def gather_full_state(model: nn.Module, ep_group: Any = None) -> dict[str, torch.Tensor]:
    """Collective over the EP group: every member returns the full state dict (experts concatenated in EP order).
    With no process group (ep=1) it is the model's own state, on CPU."""
    out = {}
    size = dist.get_world_size(ep_group) if dist.is_initialized() and ep_group is not None else 1
    for name, p in model.state_dict().items():
        if is_expert_param(name) and size > 1:
            parts = [torch.empty_like(p) for _ in range(size)]
            dist.all_gather(parts, p.contiguous(), group=ep_group)
            out[name] = torch.cat(parts, dim=0).cpu()
        else:
            out[name] = p.detach().cpu().clone()
    return out


def write_model_checkpoint(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, ep_size: int = 1,
                           step: int = 0) -> Path:
    """Write a full state dict as a model-only checkpoint for a run with `parallel.ep=ep_size` (any DP), verified by
    manifest like the trainer's own, so `model.init_from=ckpt:<out_dir>` loads it. One process writes every file
    (no collective, even under a process group)."""
    if cfg.kind == "moe" and cfg.moe.num_experts % ep_size:
        raise CheckpointError(f"{cfg.moe.num_experts} experts cannot be split over ep={ep_size}; "
                              "choose an ep dividing model.moe.num_experts")
    files: dict[str, dict[str, torch.Tensor]] = {"model/dense.pt": {k: v for k, v in state.items()
                                                                   if not is_expert_param(k)}}
    if cfg.kind == "moe":
        e_local = cfg.moe.num_experts // ep_size
        for e in range(ep_size):
            coords = layout.Coords(rank=e, dp_rank=0, ep_rank=e, ep_size=ep_size, optimizer_sharding="none",
                                   is_moe=True)
            rel = next(r for r, part in layout.model_files(coords).items() if part == "experts")
            files[rel] = {k: v[e * e_local:(e + 1) * e_local].clone() for k, v in state.items() if is_expert_param(k)}
    return write_checkpoint(Path(out_dir), step, files, _local_comm(), meta={"model": asdict(cfg)})


def _local_comm() -> Comm:
    """A Comm that answers locally even inside a process group: this writer is a single process by design."""
    comm = Comm()
    comm.active, comm.rank, comm.world_size = False, 0, 1
    return comm
