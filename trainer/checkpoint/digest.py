"""Checkpoint file digests: computed while the bytes stream out, checked in parallel before a resume.

A file's manifest entry holds one digest per SEGMENT_BYTES piece of it (`<algo>_segments`, `segment_bytes`) beside
its size. The writer feeds the bytes through `SegmentedDigest` as they go to the file, so each byte is hashed once
and no second pass exists. The check (`verify_files`) reads the segments of all of a slot's files with several
threads at once (`os.pread` at the segment's offset, each reader hashing what it read), so it is limited by the
disk's parallel read rate rather than by one stream's read plus hash. Entries with one whole-file digest (`<algo>`:
older checkpoints) are checked as a single segment.

Algorithms: xxh3_64 (python-xxhash, several GB/s, releases the GIL), zlib's crc32 where xxhash is missing; sha256
is read for manifests that name it.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from moe_launch.errors import CheckpointError

try:
    import xxhash
except ImportError:  # the slower fallback below
    xxhash = None

DIGEST = "xxh3_64" if xxhash is not None else "crc32"
ALGOS = ("xxh3_64", "crc32", "sha256")
SEGMENT_BYTES = 1 << 28
_READ_CHUNK = 1 << 25  # per pread of a reader (a reader's buffer)
READERS = max(2, min(8, os.cpu_count() or 2))


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(algo: str) -> Any:
    if algo == "xxh3_64":
        if xxhash is None:
            raise CheckpointError("the manifest uses xxh3_64 digests but python-xxhash is not installed; "
                                  "pip install xxhash")
        return xxhash.xxh3_64()
    if algo == "crc32":
        return _Crc32()
    if algo == "sha256":
        return hashlib.sha256()
    raise CheckpointError(f"unknown checkpoint digest {algo!r}")


class SegmentedDigest:
    """The digests of consecutive `segment_bytes` pieces of a byte stream, fed in chunks of any size."""

    def __init__(self, algo: str = DIGEST, segment_bytes: int = SEGMENT_BYTES):
        self.algo, self.segment_bytes = algo, segment_bytes
        self.done: list[str] = []
        self._hasher, self._filled = new_hasher(algo), 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.segment_bytes - self._filled)
            self._hasher.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.segment_bytes:
                self.done.append(self._hasher.hexdigest())
                self._hasher, self._filled = new_hasher(self.algo), 0

    def entry(self) -> dict[str, Any]:
        """The manifest fields (the size is the caller's)."""
        tail = [self._hasher.hexdigest()] if self._filled or not self.done else []
        return {f"{self.algo}_segments": self.done + tail, "segment_bytes": self.segment_bytes}


@dataclass(frozen=True)
class _Segment:
    path: Path
    offset: int
    length: int
    algo: str
    want: str
    index: int  # -1: a whole-file digest


def _segments(path: Path, info: dict) -> list[_Segment]:
    for algo in ALGOS:
        if f"{algo}_segments" in info:
            step, wants = int(info["segment_bytes"]), info[f"{algo}_segments"]
            return [_Segment(path, i * step, min(step, info["bytes"] - i * step), algo, want, i)
                    for i, want in enumerate(wants)]
        if algo in info:
            return [_Segment(path, 0, info["bytes"], algo, info[algo], -1)]
    raise CheckpointError(f"manifest entry {info} names no known digest")


def _check(seg: _Segment) -> Optional[str]:
    """None when the segment's bytes hash to the manifest's digest, else why not."""
    try:
        return _hash_range(seg)
    except OSError as e:  # EIO and the like: the slot is unusable, not the resume
        return f"{seg.path}: cannot be read ({e})"


def _hash_range(seg: _Segment) -> Optional[str]:
    h = new_hasher(seg.algo)
    buf = bytearray(min(_READ_CHUNK, max(1, seg.length)))
    fd = os.open(seg.path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, seg.offset, seg.length, os.POSIX_FADV_SEQUENTIAL)
        pos, end = seg.offset, seg.offset + seg.length
        while pos < end:
            n = os.preadv(fd, [memoryview(buf)[: min(len(buf), end - pos)]], pos)
            if n == 0:
                return f"{seg.path}: ends before byte {end} (truncated?)"
            h.update(memoryview(buf)[:n])
            pos += n
    finally:
        os.close(fd)
    if h.hexdigest() != seg.want:
        where = "" if seg.index < 0 else f" in bytes {seg.offset}..{seg.offset + seg.length}"
        return f"{seg.path}: {seg.algo} mismatch (corrupted){where}"
    return None


def verify_files(files: list[tuple[Path, dict]], readers: int = READERS) -> tuple[bool, str]:
    """(ok, reason) for (path, manifest entry) pairs: every file present with its size, every segment's digest
    matching. Sizes are checked first (no read); the segments are then read by `readers` threads at once."""
    segments: list[_Segment] = []
    for path, info in files:
        if not path.is_file():
            return False, f"{path}: missing"
        size = path.stat().st_size
        if size != info["bytes"]:
            return False, f"{path}: {size} bytes, manifest says {info['bytes']} (truncated?)"
        segments += _segments(path, info)
    segments.sort(key=lambda s: (str(s.path), s.offset))  # neighbouring reads start together: the disk streams
    with ThreadPoolExecutor(max(1, min(readers, len(segments))), thread_name_prefix="checkpoint-verify") as pool:
        futures = [pool.submit(_check, s) for s in segments]
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                reason = f.result()
                if reason is not None:
                    for other in pending:
                        other.cancel()
                    return False, reason
    return True, "ok"
