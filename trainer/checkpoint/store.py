"""Atomic, verifiable checkpoint directories written cooperatively by many ranks.

A checkpoint is a directory of files (relative paths -> torch-serialised objects) plus `manifest.json`, written
LAST, that lists every file with its sha256 and size. Protocol of `write_checkpoint(final_dir, step, files, comm)`:

  1. the leader (comm rank 0) recreates `.<name>.tmp` next to `final_dir`; barrier
  2. every rank writes ITS files (fsync each) and computes their digests — so ranks can write disjoint shards
     (DP-scattered writes: each rank passes only the shards it owns; an empty dict is fine)
  3. digests are all-gathered; the leader writes the manifest (fsync), fsyncs the tmp dir, renames an existing
     `final_dir` aside, renames tmp -> final_dir, fsyncs the parent and only then removes the old copy; barrier.

A directory without a verifying manifest is never used, so a crash at any point leaves the previous content of
every OTHER directory intact. The dual slots (ckpt-a / ckpt-b) rely on this: a new checkpoint always goes into the
slot that does NOT hold the newest valid checkpoint, so the newest valid one survives any crash.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from moe_launch.errors import CheckpointError
from moe_launch.trainer.dist import Comm
from moe_launch.trainer.host_restore import held_file, held_verified

MANIFEST = "manifest.json"
SLOTS = ("ckpt-a", "ckpt-b")
FORMAT_VERSION = 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_checkpoint(final_dir: Path, step: int, files: dict[str, Any], comm: Comm, meta: Optional[dict] = None,
                     after_shards: Optional[Callable[[], None]] = None) -> Path:
    """Collective: every rank of `comm` must call it. `files` are this rank's shards (relpath -> object);
    relpaths must be unique across ranks. `after_shards` runs on each rank once its shards are on disk, before the
    manifest exists (fault-injection hook: a kill there must leave no usable checkpoint)."""
    final_dir = Path(final_dir)
    tmp = final_dir.with_name(f".{final_dir.name}.tmp")
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    digests = {}
    for rel, obj in files.items():
        data = serialize(obj)
        _write_bytes(tmp / rel, data)
        digests[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "rank": comm.rank}
    if after_shards is not None:
        after_shards()
    merged: dict[str, dict] = {}
    for part in comm.all_gather_object(digests):
        clash = merged.keys() & part.keys()
        if clash:
            raise CheckpointError(f"checkpoint files written by two ranks: {sorted(clash)}; shard plans overlap")
        merged.update(part)
    if comm.rank == 0:
        for sub in {(tmp / rel).parent for rel in merged}:
            _fsync_dir(sub)
        manifest = {"format": FORMAT_VERSION, "step": step, "time": time.time(), "files": merged, "meta": meta or {}}
        _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fsync_dir(tmp)
        old = final_dir.with_name(f".{final_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if final_dir.exists():
            os.replace(final_dir, old)
        os.replace(tmp, final_dir)
        _fsync_dir(final_dir.parent)
        shutil.rmtree(old, ignore_errors=True)
    comm.barrier()
    return final_dir


def read_manifest(ckpt_dir: Path) -> Optional[dict]:
    try:
        manifest = json.loads((Path(ckpt_dir) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and "step" in manifest and "files" in manifest else None


def verify(ckpt_dir: Path) -> tuple[bool, str]:
    """(ok, reason): the manifest parses and every listed file exists with the recorded size and sha256."""
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        return False, f"{ckpt_dir}: missing or unreadable {MANIFEST}"
    if held_verified(ckpt_dir, manifest):  # verified when this process loaded it into memory, unchanged since
        return True, "ok"
    for rel, info in manifest["files"].items():
        path = Path(ckpt_dir) / rel
        if not path.is_file():
            return False, f"{path}: missing"
        if path.stat().st_size != info["bytes"]:
            return False, f"{path}: {path.stat().st_size} bytes, manifest says {info['bytes']} (truncated?)"
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != info["sha256"]:
            return False, f"{path}: sha256 mismatch (corrupted)"
    return True, "ok"


@dataclass
class SlotChoice:
    path: Optional[Path]  # None: nothing to resume from
    step: int = -1
    fell_back: bool = False  # the newest slot (by manifest step or presence) failed verification
    rejected: dict[str, str] = field(default_factory=dict)  # slot name -> why it was not used


def choose_resume_slot(ckpt_root: Path) -> SlotChoice:
    """The newest slot whose manifest verifies; slots with broken manifests count as 'newer' than any valid one
    (a crash mid-write is the usual cause), so using an older slot is reported as a fall-back."""
    candidates = []
    for name in SLOTS:
        d = Path(ckpt_root) / name
        if d.exists():
            m = read_manifest(d)
            candidates.append((m["step"] if m else float("inf"), name, d))
    choice = SlotChoice(path=None)
    for step, name, d in sorted(candidates, reverse=True):
        ok, reason = verify(d)
        if ok:
            choice.path, choice.step = d, int(step)
            break
        choice.rejected[name] = reason
        choice.fell_back = True
    if choice.path is None:
        choice.fell_back = False
    return choice


def next_slot(newest_valid: Optional[str]) -> str:
    """The slot to write next: never the one holding the newest valid checkpoint (its name, or None)."""
    return SLOTS[1] if newest_valid == SLOTS[0] else SLOTS[0]


def load_file(ckpt_dir: Path, rel: str, map_location: Any = "cpu") -> Any:
    path = Path(ckpt_dir) / rel
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint was written with a different layout "
                              "(parallel.* or model.kind changed?); resume with the original parallel config")
    held = held_file(path)  # already in host memory (a warm standby's, trainer/host_restore.py)
    if held is not None and map_location == "cpu":
        return held
    return torch.load(path, map_location=map_location, weights_only=True)
