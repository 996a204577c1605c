"""What goes into a checkpoint and how it comes back: model parts, optimizer shard, RNG states, trainer state.

Files and writers are defined in checkpoint/layout.py, the atomic write protocol in checkpoint/store.py.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from moe_launch.errors import CheckpointError
from moe_launch.trainer.checkpoint import layout
from moe_launch.trainer.checkpoint.store import load_file, verify, write_checkpoint
from moe_launch.trainer.dist import Comm


def model_part(model: nn.Module, part: str) -> dict[str, torch.Tensor]:
    """'dense' (every non-expert parameter) or 'experts' (this rank's local expert slices), detached on CPU."""
    want_expert = part == "experts"
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()
            if bool(getattr(p, "_moe_expert", False)) == want_expert}


def capture_rng(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _builders(c: layout.Coords, model: nn.Module, optimizer: Any, trainer_state: dict, device: torch.device
              ) -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {rel: (lambda part=part: model_part(model, part))
                                         for rel, part in layout.model_files(c).items()}
    if optimizer is not None:
        out[layout.optimizer_file(c)] = optimizer.state_dict
    out[layout.rng_file(c)] = lambda: capture_rng(device)
    out[layout.TRAINER_FILE] = lambda: trainer_state
    return out


def save(ckpt_dir: Path, step: int, c: layout.Coords, model: nn.Module, optimizer: Any, trainer_state: dict,
         comm: Comm, device: torch.device, model_only: bool = False, meta: Optional[dict] = None,
         after_shards: Optional[Callable[[], None]] = None) -> Path:
    """Collective over `comm`: each rank writes its files of the layout (optimizer may be None if model_only)."""
    builders = _builders(c, model, None if model_only else optimizer, trainer_state, device)
    files = {rel: builders[rel]() for rel in layout.writes(c, model_only=model_only)}
    return write_checkpoint(ckpt_dir, step, files, comm, meta=meta, after_shards=after_shards)


def load_model(ckpt_dir: Path, c: layout.Coords, model: nn.Module) -> None:
    sd: dict[str, torch.Tensor] = {}
    for rel in layout.model_files(c):
        sd.update(load_file(ckpt_dir, rel))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{ckpt_dir}: model parameters do not match (missing {missing[:4]}, unexpected "
                              f"{unexpected[:4]}); use the same model.* config as the run that wrote it")


def load_optimizer(ckpt_dir: Path, c: layout.Coords, optimizer: Any) -> None:
    optimizer.load_state_dict(load_file(ckpt_dir, layout.optimizer_file(c)))


def load_rng(ckpt_dir: Path, c: layout.Coords, device: torch.device) -> None:
    restore_rng(load_file(ckpt_dir, layout.rng_file(c)), device)


def load_trainer_state(ckpt_dir: Path) -> dict:
    return load_file(ckpt_dir, layout.TRAINER_FILE)


def verified_model_dir(spec: str) -> Path:
    """The directory of model.init_from=ckpt:/path, checked against its manifest."""
    path = Path(spec.removeprefix("ckpt:")).expanduser()
    ok, reason = verify(path)
    if not ok:
        raise CheckpointError(f"model.init_from={spec}: {reason}; point it at a complete checkpoints/model-step-N")
    return path
