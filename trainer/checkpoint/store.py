"""Atomic, verifiable checkpoint directories written cooperatively by many ranks.

A checkpoint is a directory of files (relative paths -> torch-serialised objects) plus `manifest.json`, written
LAST, that lists every file with its digest and size. Protocol of `write_checkpoint(final_dir, step, files, comm)`:

  1. the leader (comm rank 0) recreates `.<name>.tmp` next to `final_dir`; barrier
  2. every rank writes ITS files (fsync each), digesting the bytes as they stream to the file (no second pass) —
     so ranks can write disjoint shards (DP-scattered writes: each rank passes only the shards it owns; an empty
     dict is fine)
  3. digests (or each rank's write error) are all-gathered; if any rank failed, every rank raises
     CheckpointWriteError and the leader removes the tmp dir; otherwise the leader writes the manifest (fsync),
     fsyncs the tmp dir, renames an existing `final_dir` aside, renames tmp -> final_dir, fsyncs the parent,
     records the checkpoint (`on_commit`) and only then removes the old copy; it broadcasts the outcome.

A directory without a verifying manifest is never used, so a crash or a write error at any point leaves the previous
content of every OTHER directory intact. The dual slots (ckpt-a / ckpt-b) rely on this: a new checkpoint always goes
into the slot that does NOT hold the newest valid checkpoint, so the newest valid one survives any crash.

Digests (checkpoint/digest.py): one per 256 MiB segment of each file, xxh3-64 (or crc32 without python-xxhash),
computed as the bytes stream out; `verify` checks a slot's segments with several reader threads at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from moe_launch.errors import CheckpointError
from moe_launch.trainer.checkpoint.digest import DIGEST, SegmentedDigest, verify_files
from moe_launch.trainer.dist import Comm
from moe_launch.trainer.host_restore import held_file, held_verified
from moe_launch.trainer.tracking.steplog import LOGGER

MANIFEST = "manifest.json"
SLOTS = ("ckpt-a", "ckpt-b")
FORMAT_VERSION = 1


class CheckpointWriteError(CheckpointError):
    """A rank could not write its files (ENOSPC, EIO, a read-only file system...); names the path and the error."""

    def __init__(self, path: str, error: str):
        self.path, self.error = path, error
        super().__init__(f"writing {path} failed: {error}; the older checkpoint slot is untouched. Free space on (or "
                         "fix) the checkpoint file system, then resume")


def _libc_sync_file_range() -> Optional[Callable[[int, int, int], None]]:
    """sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE): start writing those dirty pages back, without
    waiting (Linux); None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)

    def start_writeback(fd: int, offset: int, n: int) -> None:
        fn(fd, offset, n, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the head start

    return start_writeback


_start_writeback = _libc_sync_file_range()
_WRITE_CHUNK = 1 << 26  # bytes per write(): the digest and the disk's writeback follow the serialiser closely
_THREADED_WRITE = 1 << 20


class _DigestingFile:
    """The file object torch.save writes into: every chunk (a memoryview of the tensor's own host memory, no copy)
    is hashed and written straight through, so serialisation, digest and write are one pass. The write of a chunk
    runs on `writer` while this thread hashes it (both release the GIL), so the digest costs no disk time. Each
    chunk's writeback is started at once: left to the kernel it would wait until gigabytes are dirty (or 30 s old),
    leaving the disk idle while the page cache fills, and the final fsync would then wait for all of it."""

    def __init__(self, fd: int, algo: str, writer: ThreadPoolExecutor):
        self.fd, self.hasher, self.nbytes, self.writer = fd, SegmentedDigest(algo), 0, writer
        self.error: Optional[OSError] = None  # the first write error; torch.save's own cleanup would mask it

    def _write_all(self, chunk: memoryview) -> int:
        done = 0
        while done < len(chunk):
            done += os.write(self.fd, chunk[done:])
        if _start_writeback is not None:
            _start_writeback(self.fd, self.nbytes, done)
        return done

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.error is not None:  # torch.save closing its zip after our error: swallow, write_file re-raises
            return len(view)
        try:
            for lo in range(0, len(view), _WRITE_CHUNK):
                chunk = view[lo : lo + _WRITE_CHUNK]
                if len(chunk) < _THREADED_WRITE:  # zip headers, small tensors: a hand-off would cost more
                    self.hasher.update(chunk)
                    self.nbytes += self._write_all(chunk)
                    continue
                written = self.writer.submit(self._write_all, chunk)
                self.hasher.update(chunk)
                self.nbytes += written.result()  # before returning: torch.save may reuse `data`'s memory
        except OSError as e:
            self.error = e
            raise
        return len(view)

    def flush(self) -> None:
        pass


_crc_lock = threading.Lock()


@contextlib.contextmanager
def _no_zip_crc() -> Iterator[None]:
    """torch.save's zip records carry a crc32 by default: a second slow pass over every byte that our digest
    already covers. torch.load does not need it."""
    setter = getattr(torch.serialization, "set_crc32_options", None)
    getter = getattr(torch.serialization, "get_crc32_options", None)
    if setter is None or getter is None:
        yield
        return
    with _crc_lock:
        before = getter()
        setter(False)
        try:
            yield
        finally:
            setter(before)


def write_file(path: Path, obj: Any, algo: str = DIGEST, fsync: bool = True) -> dict[str, Any]:
    """Serialise `obj` into `path` (fsynced unless `fsync=False`: then `fsync_file` it before relying on it);
    returns its manifest entry (segment digests and "bytes": n, checkpoint/digest.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-write") as writer:
            out = _DigestingFile(fd, algo, writer)
            _serialise(obj, out)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {**out.hasher.entry(), "bytes": out.nbytes}


def _serialise(obj: Any, out: _DigestingFile) -> None:
    try:
        with _no_zip_crc():
            torch.save(obj, out)
    except Exception:
        if out.error is not None:
            raise out.error from None
        raise
    if out.error is not None:
        raise out.error


def fsync_file(path: Path) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is)."""
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


def room_needed(free_bytes: int, replaced_bytes: int) -> bool:
    """Pure: whether the older slot must go before its replacement is written (the new checkpoint is as large as the
    one it replaces; a margin for the manifest and the file system's own blocks)."""
    return free_bytes < replaced_bytes * 1.05 + (64 << 20)


def _make_room(final_dir: Path) -> None:
    """A disk with room for two checkpoints but not three: the slot about to be replaced (never the newest valid
    one) is removed before the new one is written, not after, so the run goes on with one valid checkpoint during the
    write instead of failing with ENOSPC. With room to spare the older slot stays until the new one is in place."""
    if not final_dir.exists():
        return
    replaced = checkpoint_bytes(final_dir) or sum(f.stat().st_size for f in final_dir.rglob("*") if f.is_file())
    free = shutil.disk_usage(final_dir.parent).free
    if room_needed(free, replaced):
        logging.getLogger(LOGGER).warning(
            f"{final_dir.parent}: {free / 1e9:.2f} GB free, a checkpoint takes {replaced / 1e9:.2f} GB: removing "
            f"the older slot {final_dir.name} before writing its replacement (until then the newest checkpoint is "
            "the only valid one; give the checkpoint directory room for three to keep both)")
        shutil.rmtree(final_dir)


def write_checkpoint(final_dir: Path, step: int, files: dict[str, Any], comm: Comm, meta: Optional[dict] = None,
                     after_shards: Optional[Callable[[], None]] = None,
                     on_commit: Optional[Callable[[Path], None]] = None) -> Path:
    """Collective: every rank of `comm` must call it. `files` are this rank's shards (relpath -> object, or a
    zero-argument callable returning it, called just before its file is written); relpaths must be unique across
    ranks. `after_shards` runs on each rank once its shards are on disk, before the manifest exists (fault-injection
    hook: a kill there must leave no usable checkpoint). `on_commit(final_dir)` runs on rank 0 the moment the
    checkpoint is valid, before the other ranks hear of it: a peer lost during that last exchange fails the write
    there, yet the checkpoint is valid and a resume will use it, so it must be on record. Raises
    CheckpointWriteError on every rank if any rank's write failed (nothing renamed, the tmp dir removed)."""
    final_dir = Path(final_dir)
    tmp = final_dir.with_name(f".{final_dir.name}.tmp")
    failure: Optional[tuple[str, str]] = None
    if comm.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            _make_room(final_dir)
            tmp.mkdir(parents=True)
        except OSError as e:
            failure = (str(tmp), _describe(e))
    comm.barrier()
    digests: dict[str, dict] = {}
    for rel, obj in files.items():  # the kernel writes a file back while the next one is serialised;
        if failure is not None:       # all are fsynced below, before any manifest can name them
            break
        try:
            digests[rel] = {**write_file(tmp / rel, obj() if callable(obj) else obj, fsync=False), "rank": comm.rank}
        except OSError as e:
            failure = (str(tmp / rel), _describe(e))
    for rel in digests if failure is None else ():
        try:
            fsync_file(tmp / rel)
        except OSError as e:
            failure = (str(tmp / rel), _describe(e))
            break
    if after_shards is not None and failure is None:
        after_shards()
    parts = comm.all_gather_object(failure if failure is not None else digests)
    failed = [p for p in parts if isinstance(p, tuple)]
    if failed:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()
        raise CheckpointWriteError(*failed[0])
    merged: dict[str, dict] = {}
    for part in parts:
        clash = merged.keys() & part.keys()
        if clash:
            raise CheckpointError(f"checkpoint files written by two ranks: {sorted(clash)}; shard plans overlap")
        merged.update(part)
    commit_error: Optional[tuple[str, str]] = None
    if comm.rank == 0:
        try:
            _commit(final_dir, tmp, step, merged, meta, on_commit)
        except OSError as e:
            commit_error = (str(final_dir), _describe(e))
            shutil.rmtree(tmp, ignore_errors=True)
    commit_error = comm.broadcast_object(commit_error)
    if commit_error is not None:
        raise CheckpointWriteError(*commit_error)
    return final_dir


def _commit(final_dir: Path, tmp: Path, step: int, merged: dict[str, dict], meta: Optional[dict],
            on_commit: Optional[Callable[[Path], None]] = None) -> None:
    for sub in {(tmp / rel).parent for rel in merged}:
        fsync_file(sub)
    manifest = {"format": FORMAT_VERSION, "step": step, "time": time.time(), "files": merged, "meta": meta or {}}
    _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    fsync_file(tmp)
    old = final_dir.with_name(f".{final_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final_dir.exists():
        os.replace(final_dir, old)
    os.replace(tmp, final_dir)
    fsync_file(final_dir.parent)
    if on_commit is not None:
        try:
            on_commit(final_dir)
        except Exception as e:  # a record that cannot be written must not fail a valid checkpoint
            logging.getLogger(LOGGER).warning(f"{final_dir}: written, but recording it failed: {e}")
    shutil.rmtree(old, ignore_errors=True)


def _describe(e: OSError) -> str:
    name = os.strerror(e.errno) if e.errno else type(e).__name__
    return f"{name} ({type(e).__name__}: {e})"


def checkpoint_bytes(ckpt_dir: Path) -> int:
    manifest = read_manifest(ckpt_dir) or {"files": {}}
    return sum(int(info["bytes"]) for info in manifest["files"].values())


def read_manifest(ckpt_dir: Path) -> Optional[dict]:
    try:
        manifest = json.loads((Path(ckpt_dir) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and "step" in manifest and "files" in manifest else None


def verify(ckpt_dir: Path) -> tuple[bool, str]:
    """(ok, reason): the manifest parses and every listed file exists with the recorded size and digest."""
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        return False, f"{ckpt_dir}: missing or unreadable {MANIFEST}"
    if held_verified(ckpt_dir, manifest):  # verified when this process loaded it into memory, unchanged since
        return True, "ok"
    return verify_files([(Path(ckpt_dir) / rel, info) for rel, info in manifest["files"].items()])


@dataclass
class SlotChoice:
    path: Optional[Path]  # None: nothing to resume from
    step: int = -1
    fell_back: bool = False  # the newest slot (by manifest step or presence) failed verification
    rejected: dict[str, str] = field(default_factory=dict)  # slot name -> why it was not used


def _candidates(ckpt_root: Path) -> list[tuple[float, str, Path]]:
    """The slots present, newest first; a slot with a broken manifest counts as newer than any valid one (a crash
    mid-write is the usual cause), so using an older slot is reported as a fall-back."""
    found = []
    for name in SLOTS:
        d = Path(ckpt_root) / name
        if d.exists():
            m = read_manifest(d)
            found.append((m["step"] if m else float("inf"), name, d))
    return sorted(found, reverse=True)


def choose_resume_slot(ckpt_root: Path, skip: Optional[dict[str, str]] = None) -> SlotChoice:
    """The newest slot whose manifest verifies. `skip`: slots already rejected, {name: why}."""
    choice = SlotChoice(path=None)
    for step, name, d in _candidates(ckpt_root):
        ok, reason = (False, skip[name]) if skip and name in skip else verify(d)
        if ok:
            choice.path, choice.step = d, int(step)
            break
        choice.rejected[name] = reason
        choice.fell_back = True
    if choice.path is None:
        choice.fell_back = False
    return choice


class PendingResume:
    """The newest slot with a manifest, its digest check running in a thread of its own so the loads can read the
    slot meanwhile (both read the same pages, so the disk reads each byte once). `confirm()` says whether the check
    passed; when it did not, what was loaded is discarded and `choose_resume_slot(root, skip=rejected)` decides.
    `skip`: slots already known bad, {name: why}. `on_reject(name, step, reason)` runs in the check's thread when
    the check fails, so the rejection is recorded even while the caller is blocked elsewhere."""

    def __init__(self, ckpt_root: Path, skip: Optional[dict[str, str]] = None,
                 on_reject: Optional[Callable[[str, int, str], None]] = None):
        self.choice = SlotChoice(path=None)
        self._check: Optional[ThreadPoolExecutor] = None
        self._future = None
        for step, name, d in _candidates(ckpt_root):
            if step == float("inf") or (skip and name in skip):  # rejected without reading its files
                self.choice.rejected[name] = (skip or {}).get(name) or verify(d)[1]  # no manifest: verify says so
                self.choice.fell_back = True
                continue
            self.choice.path, self.choice.step = d, int(step)
            self._check = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-verify-resume")
            self._future = self._check.submit(self._verify, d, name, int(step), on_reject)
            break
        if self.choice.path is None:
            self.choice.fell_back = False

    @staticmethod
    def _verify(d: Path, name: str, step: int, on_reject) -> tuple[bool, str]:
        ok, reason = verify(d)
        if not ok and on_reject is not None:
            on_reject(name, step, reason)
        return ok, reason

    def confirm(self) -> tuple[bool, str]:
        """(ok, reason) of the chosen slot's check (True when there is nothing to check)."""
        if self._future is None:
            return True, "ok"
        try:
            return self._future.result()
        finally:
            self._check.shutdown()
            self._check, self._future = None, None


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
    # mmap: the tensors are the page cache's pages (which the digest check just read), not a second copy
    return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
