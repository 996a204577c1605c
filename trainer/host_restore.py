"""Restore from host memory: a verified checkpoint slot's files held by this process, so a resume reads no disk.

A warm standby (trainer/standby.py) holds the newest complete slot while it waits (`HoldNewest`, a background
thread): each file is checked against the manifest's digest, which reads it into the page cache, then loaded with
`torch.load(mmap=True)`, so its tensors are those cached pages (no second copy; standbys on one machine share them).
When the standby becomes a rank, the resume finds that slot verified (`held_verified`) and its files loaded
(`held_file`) for as long as every file is still the one that was read (same inode, size and modification time: a
new checkpoint replaces files, it never rewrites them in place). Anything else is read from the disk as usual, so
holding never changes what is restored, only where it is read from.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

_POLL_S = 1.0


@dataclass(frozen=True)
class Held:
    ckpt_dir: Path  # resolved
    step: int
    manifest_files: dict[str, Any]
    objs: dict[str, Any]  # relative path -> the loaded object
    stamps: dict[str, tuple[int, int, int]]  # relative path -> (inode, size, mtime_ns) when read


_held: Optional[Held] = None


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _unchanged(held: Held) -> bool:
    try:
        return all(_stamp(held.ckpt_dir / rel) == stamp for rel, stamp in held.stamps.items())
    except OSError:
        return False


def hold(ckpt_dir: Path, should_stop: Callable[[], bool] = lambda: False) -> bool:
    """Verify and load every file of the slot `ckpt_dir`; on success it becomes the held slot (the previous one is
    dropped). False: incomplete, failing its digests, replaced while being read, or `should_stop()` said so."""
    import torch

    from moe_launch.trainer.checkpoint.store import read_manifest, verify

    global _held
    ckpt_dir = Path(ckpt_dir).resolve()
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        return False
    try:
        stamps = {rel: _stamp(ckpt_dir / rel) for rel in manifest["files"]}
    except OSError:
        return False
    if not verify(ckpt_dir)[0]:
        return False
    objs = {}
    for rel in manifest["files"]:
        if should_stop():
            return False
        objs[rel] = torch.load(ckpt_dir / rel, map_location="cpu", weights_only=True, mmap=True)
        _map_pages(objs[rel], torch)
    held = Held(ckpt_dir, int(manifest["step"]), dict(manifest["files"]), objs, stamps)
    if not _unchanged(held):  # replaced while being read
        return False
    _held = held
    return True


def _map_pages(obj: Any, torch: Any) -> None:
    """Touch one byte per page of every tensor in `obj`: the pages are in the page cache (the digest read them), but a
    fresh mapping faults on first access, page by page; done here, in the background, not in the restore."""
    if isinstance(obj, torch.Tensor):
        if obj.numel() and obj.is_contiguous():
            obj.reshape(-1).view(torch.uint8)[::4096].sum()
    elif isinstance(obj, dict):
        for v in obj.values():
            _map_pages(v, torch)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _map_pages(v, torch)


def held_step() -> Optional[int]:
    return _held.step if _held is not None else None


def held_verified(ckpt_dir: Path, manifest: dict[str, Any]) -> bool:
    """`ckpt_dir` with this `manifest` is the held slot, unchanged since its files were verified."""
    h = _held
    return (h is not None and Path(ckpt_dir).resolve() == h.ckpt_dir and manifest["files"] == h.manifest_files
            and _unchanged(h))


def held_file(path: Path) -> Any:
    """The held object of the checkpoint file `path`, or None (not held, or replaced since)."""
    h = _held
    if h is None:
        return None
    path = Path(path).resolve()
    try:
        rel = str(path.relative_to(h.ckpt_dir))
        if rel not in h.objs or _stamp(path) != h.stamps[rel]:
            return None
    except (ValueError, OSError):
        return None
    return h.objs[rel]


def newest_complete_slot(ckpt_root: Path, slots: tuple[str, ...]) -> Optional[Path]:
    """The slot with the highest manifest step (complete as far as its manifest says; `hold` verifies it)."""
    from moe_launch.trainer.checkpoint.store import read_manifest

    best: Optional[tuple[int, Path]] = None
    for name in slots:
        m = read_manifest(Path(ckpt_root) / name)
        if m is not None and (best is None or int(m["step"]) > best[0]):
            best = (int(m["step"]), Path(ckpt_root) / name)
    return best[1] if best else None


class HoldNewest:
    """A thread that keeps the newest complete slot of `ckpt_root` held until `stop()`; a slot being loaded when
    stop() comes is abandoned at its next file."""

    def __init__(self, ckpt_root: Path):
        from moe_launch.trainer.checkpoint.store import SLOTS

        self.root, self.slots = Path(ckpt_root), tuple(SLOTS)
        self._stop = threading.Event()
        self._tried: Optional[tuple[Path, tuple[int, int, int]]] = None  # a slot that did not hold, by its manifest
        self._thread = threading.Thread(target=self._run, daemon=True, name="hold-newest-checkpoint")
        self._thread.start()

    def _run(self) -> None:
        from moe_launch.trainer.checkpoint.store import MANIFEST

        while not self._stop.is_set():
            slot = newest_complete_slot(self.root, self.slots)
            held = _held
            if slot is not None and not (held is not None and held.ckpt_dir == slot.resolve() and _unchanged(held)):
                try:
                    attempt = (slot, _stamp(slot / MANIFEST))
                except OSError:
                    attempt = None
                if attempt is not None and attempt != self._tried and not hold(slot, self._stop.is_set):
                    self._tried = attempt  # corrupt or replaced: not again until its manifest changes
            self._stop.wait(_POLL_S)

    def stop(self) -> None:
        self._stop.set()


def is_held(ckpt_dir: Optional[Path]) -> bool:
    """The slot `ckpt_dir` is held, unchanged: a resume from it reads host memory."""
    h = _held
    return ckpt_dir is not None and h is not None and Path(ckpt_dir).resolve() == h.ckpt_dir and _unchanged(h)
