"""What goes into a checkpoint and how it comes back: model parts, optimizer shard, RNG states, trainer state.

Files and writers are defined in checkpoint/layout.py, the atomic write protocol in checkpoint/store.py.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from moe_launch.errors import CheckpointError
from moe_launch.kernels.adamw import join_master
from moe_launch.trainer.checkpoint import layout
from moe_launch.trainer.checkpoint.snapshot import HostSnapshot
from moe_launch.trainer.checkpoint.store import load_file, read_manifest, verify, write_checkpoint
from moe_launch.trainer.dist import Comm
from moe_launch.trainer.parallel.comm import broadcast_
from moe_launch.trainer.parallel.groups import Groups
from moe_launch.trainer.parallel.optimizer import state_dict_from_views


def model_part(model: nn.Module, part: str) -> dict[str, torch.Tensor]:
    """'dense' (every non-expert parameter) or 'experts' (this rank's local expert slices): the live parameters,
    detached, not copied (a HostSnapshot copies them to host memory)."""
    want_expert = part == "experts"
    return {n: p.detach() for n, p in model.named_parameters()
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


def device_state(rels: list[str], files: FileNames, model: nn.Module, optimizer: Any, trainer_state: dict,
                 device: torch.device) -> dict[str, Any]:
    """{relpath: tree of live tensors and values} of the files `rels` (this rank's writes): nothing is copied, so
    this allocates nothing on the device. `HostSnapshot.capture` copies the trees to host memory."""
    out: dict[str, Any] = {}
    for rel in rels:
        if rel in files.model:
            out[rel] = model_part(model, files.model[rel])
        elif rel == files.optimizer:
            out[rel] = optimizer.state_views()
        elif rel == files.rng:
            out[rel] = capture_rng(device)
        elif rel == layout.TRAINER_FILE:
            out[rel] = trainer_state
        else:
            raise CheckpointError(f"no builder for checkpoint file {rel}: the layout and the state disagree")
    return out


def file_object(rel: str, files: FileNames, scratch: Optional[Scratch] = None) -> Callable[[dict], Any]:
    """The object saved as `rel`, from the host copy of `device_state`: the optimizer's views become its
    state_dict (the fp32 master joined on the host, chunk by chunk into `scratch` buffers when given), everything
    else is saved as captured."""
    if rel == files.optimizer:
        return lambda host: state_dict_from_views(_joined_on_host(host[rel], scratch) if scratch else host[rel])
    return lambda host: host[rel]


Scratch = Callable[[str, torch.Size], torch.Tensor]  # (key, shape) -> a reusable fp32 host buffer
JOIN_CHUNK = 1 << 24  # elements per join: bounds the int32 temporaries to 64 MiB


def _joined_on_host(views: dict, scratch: Scratch) -> dict:
    """The optimizer views with every bf16 master (parameter + remainder) joined into an fp32 scratch buffer."""
    out = dict(views, buckets={})
    for name, v in views["buckets"].items():
        if v["remainder"] is not None:
            p_S, r_S = v["param_shard"], v["remainder"]
            master_S = scratch(f"{name}/master", p_S.shape)
            for lo in range(0, p_S.numel(), JOIN_CHUNK):
                master_S[lo : lo + JOIN_CHUNK] = join_master(p_S[lo : lo + JOIN_CHUNK], r_S[lo : lo + JOIN_CHUNK])
            v = dict(v, param_shard=master_S, remainder=None)
        out["buckets"][name] = v
    return out


@dataclass(frozen=True)
class FileNames:
    """The names of one rank's checkpoint files: {model relpath: part}, its optimizer file, its RNG file."""

    model: dict[str, str]
    optimizer: str
    rng: str

    @classmethod
    def of(cls, c: layout.Coords) -> "FileNames":
        return cls(layout.model_files(c), layout.optimizer_file(c), layout.rng_file(c))


def save(ckpt_dir: Path, step: int, c: layout.Coords, model: nn.Module, optimizer: Any, trainer_state: dict,
         comm: Comm, device: torch.device, model_only: bool = False, meta: Optional[dict] = None,
         after_shards: Optional[Callable[[], None]] = None) -> Path:
    """Synchronous save. Collective over `comm`: each rank writes its files of the layout (optimizer may be None if
    model_only). The trainer saves asynchronously through checkpoint/persist.py instead."""
    return save_files(ckpt_dir, step, layout.writes(c, model_only=model_only), FileNames.of(c), model, optimizer,
                      trainer_state, comm, device, meta=meta, after_shards=after_shards)


def save_files(ckpt_dir: Path, step: int, rels: list[str], files: FileNames, model: nn.Module, optimizer: Any,
               trainer_state: dict, comm: Comm, device: torch.device, meta: Optional[dict] = None,
               after_shards: Optional[Callable[[], None]] = None) -> Path:
    snap = HostSnapshot(device)
    host = snap.capture(device_state(rels, files, model, optimizer, trainer_state, device), step)
    snap.wait()
    objs = {rel: file_object(rel, files)(host) for rel in rels}
    return write_checkpoint(ckpt_dir, step, objs, comm, meta=meta, after_shards=after_shards)


def load_model(ckpt_dir: Path, c: layout.Coords, model: nn.Module) -> None:
    """Load this rank's parameters (its stage's, its EP rank's experts). Reads its own files when they hold every
    name (the same PP layout); otherwise every stage's files of its EP coordinate, so a checkpoint written under
    another PP split (or unpipelined) loads too: the parameter names are the full model's in every layout."""
    want = set(model.state_dict())
    sd: dict[str, torch.Tensor] = {}
    for rel in layout.model_files(c):
        if (Path(ckpt_dir) / rel).is_file():
            sd.update(load_file(ckpt_dir, rel))
    if not want <= set(sd):
        manifest = read_manifest(Path(ckpt_dir)) or {"files": {}}
        stages = sorted({int(m.group(1)) for rel in manifest["files"] if (m := re.match(r"model/pp(\d+)/", rel))})
        saved = dataclasses.replace(c, pp_size=max(len(stages), 1))  # the saved run's stage naming
        rels = [rel for p in (stages or [0]) for rel in layout.model_files(saved, p)]
        sd = {}
        for rel in rels:
            sd.update({k: v for k, v in load_file(ckpt_dir, rel).items() if k in want})
    missing = sorted(want - set(sd))
    if missing:
        raise CheckpointError(f"{ckpt_dir}: parameters {missing[:4]} of this rank are in no model file; use the "
                              "same model.* config (and parallel.ep) as the run that wrote it")
    model.load_state_dict({k: sd[k] for k in want}, strict=True)


def load_optimizer(ckpt_dir: Path, c: layout.Coords, optimizer: Any, groups: Optional[Groups] = None) -> list[str]:
    """Load this rank's optimizer state; returns the files this rank read. With optimizer_sharding=none the file is
    replicated over the DP group: given `groups`, only DP rank 0 reads it and broadcasts the state to the others
    (collective over the DP group), so a replica group reads its file once."""
    rel = layout.optimizer_file(c)
    if c.optimizer_sharding != "none" or groups is None or groups.dp_size == 1:
        optimizer.load_state_dict(load_file(ckpt_dir, rel))
        return [rel]
    read = []
    if groups.dp_rank == 0:
        optimizer.load_state_dict(load_file(ckpt_dir, rel))
        read = [rel]
    _broadcast_optimizer_state(optimizer, groups)
    return read


@torch.no_grad()
def _broadcast_optimizer_state(optimizer: Any, groups: Groups) -> None:
    """DP rank 0's replicated optimizer state to the rest of its DP group, in place (parameter shard, bf16
    remainder, moments, step count)."""
    step_1 = torch.tensor([optimizer.step_count], dtype=torch.int64, device=optimizer.buckets[0].exp_avg.device
                          if optimizer.buckets else "cpu")
    broadcast_(step_1, groups.dp, src_index=0)
    optimizer.step_count = int(step_1.item())
    for b in optimizer.buckets:
        b.adopt_param_storage()
        tensors = (b.param_shard, b.exp_avg, b.exp_avg_sq) + ((b.remainder,) if b.dtype == torch.bfloat16 else ())
        for t in tensors:
            broadcast_(t, groups.dp, src_index=0)


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
