"""Asynchronous checkpoints: snapshot the state at a step end, persist it from a background thread.

    ckpt = AsyncCheckpointer(device, comm, on_result)   # comm: a group of its own (the writer's collectives run
                                                        # beside the training's), see `checkpoint_comm`
    stall_s = ckpt.request(step, targets, state)        # at a step end, after the optimizer step
    ckpt.fence()                                        # before the next optimizer update (GPU-side wait only)
    result = ckpt.wait()                                # durable (or failed); at exit, preemption, time limit

`request` first waits for the previous persist (one in flight at a time: it reads the same host buffers, and the
slot choice of the next checkpoint needs its outcome), then captures `state` ({relpath: tree of tensors}) into the
reusable host buffers of `snapshot.HostSnapshot` and hands the write to a new background thread. That thread waits
for the copies, then runs `store.write_checkpoint` for each target in order (serialise, digest, write, fsync,
manifest last, atomic rename), calls `on_commit(PersistResult)` on rank 0 as each target becomes valid, and
finally calls `on_result(PersistResult)` on every rank. Write errors (ENOSPC,
EIO, EROFS) come back as a failed result naming the path and the error, identical on every rank (the store
all-gathers them), so every rank takes the same decision at its next `wait`.

The host copy of the newest snapshot stays readable as `ckpt.snapshot.tree` (for `snapshot.step`) until the next
`request`; after `wait()` it is complete.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from moe_launch.trainer.checkpoint.snapshot import HostSnapshot
from moe_launch.trainer.checkpoint.store import CheckpointWriteError, checkpoint_bytes, write_checkpoint
from moe_launch.trainer.dist import Comm


@dataclass
class Target:
    """One checkpoint directory to write from the snapshot: `files` maps this rank's relpaths to the key of their
    tree in the captured state, or to a function of the captured state returning the object to save."""

    final_dir: Path
    files: dict[str, Callable[[dict], Any]]
    meta: Optional[dict] = None
    model_only: bool = False
    after_shards: Optional[Callable[[], None]] = None


@dataclass
class PersistResult:
    step: int
    dirs: list[str]
    ok: bool
    stall_s: float  # training blocked in request()
    durable_s: float  # from request() to the last manifest renamed into place (or to the failure)
    bytes: int  # all ranks' files of the targets written (their manifests' sizes)
    waited_s: float = 0.0  # part of the stall spent waiting for the previous persist
    done: list[str] = field(default_factory=list)  # targets written (a failure stops at the failing one)
    error: Optional[str] = None
    error_path: Optional[str] = None


def checkpoint_comm(device: torch.device) -> Comm:
    """A gloo group of its own for the background writer (collective: every rank calls it at the same point); a
    world of one needs none."""
    if not dist.is_initialized():
        return Comm(device)
    return Comm(torch.device("cpu"), group=dist.new_group(backend="gloo"))


class AsyncCheckpointer:
    def __init__(self, device: torch.device, comm: Comm, on_result: Callable[[PersistResult], None],
                 on_commit: Optional[Callable[[PersistResult], None]] = None):
        self.snapshot = HostSnapshot(device)
        self.comm, self.on_result, self.on_commit = comm, on_result, on_commit
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[PersistResult] = None
        self._exc: Optional[BaseException] = None
        self.closed = False

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    @property
    def busy(self) -> bool:
        """The background write is still running (in_flight stays true until its result is taken)."""
        return self._thread is not None and self._thread.is_alive()

    def request(self, step: int, targets: list[Target], state: dict[str, Any],
                since: Optional[float] = None) -> tuple[float, Optional[PersistResult]]:
        """Capture `state` and persist it to `targets` in the background. Returns (stall_s, the previous persist's
        result if one was still in flight or unread). `since`: the perf_counter at which the caller began waiting
        for the previous persist itself (its wait counts in stall_s and waited_s)."""
        if self.closed:
            raise RuntimeError("checkpoint request after close()")
        t0 = time.perf_counter() if since is None else since
        previous = self.wait()
        waited_s = time.perf_counter() - t0
        host = self.snapshot.capture(state, step)
        stall_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._persist, args=(step, targets, host, t0, stall_s, waited_s),
                                        name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()
        return stall_s, previous

    def fence(self) -> None:
        self.snapshot.fence()

    def wait(self) -> Optional[PersistResult]:
        """Block until the in-flight persist ended; its result (None when there was none). Errors other than
        write errors (a bug, a lost peer) are raised here."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if self._exc is not None:
            exc, self._exc = self._exc, None
            raise exc
        result, self._result = self._result, None
        return result

    def close(self) -> None:
        """Release the writer's group after the last `wait()` (left to the interpreter's exit, a gloo group's
        teardown can abort the process). No request after this."""
        if self._thread is not None:
            raise RuntimeError("close() with a persist in flight: wait() first")
        if not self.closed and self.comm.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.comm.group)
        self.closed = True

    def _persist(self, step: int, targets: list[Target], host: dict, t0: float, stall_s: float,
                 waited_s: float) -> None:
        try:
            self.snapshot.wait()
            result = PersistResult(step=step, dirs=[str(t.final_dir) for t in targets], ok=True, stall_s=stall_s,
                                   durable_s=0.0, bytes=0, waited_s=waited_s)
            for t in targets:
                # a builder thread prepares the files in write order (the optimizer's masters are joined on the
                # host) while the earlier files are being written
                with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-build") as builder:
                    built = {rel: builder.submit(build, host) for rel, build in t.files.items()}
                    files = {rel: future.result for rel, future in built.items()}
                    try:
                        write_checkpoint(t.final_dir, step, files, self.comm, meta=t.meta,
                                         after_shards=t.after_shards,
                                         on_commit=lambda d: self._committed(d, step, t0, stall_s, waited_s))
                    except CheckpointWriteError as e:
                        result.ok, result.error, result.error_path = False, e.error, e.path
                        for future in built.values():
                            future.cancel()
                if not result.ok:
                    break
                result.done.append(str(t.final_dir))
            result.durable_s = time.perf_counter() - t0
            result.bytes = sum(checkpoint_bytes(Path(d)) for d in result.done)
            self._result = result
            self.on_result(result)
        except BaseException as e:  # handed to the training thread at its next wait()
            self._exc = e

    def _committed(self, final_dir: Path, step: int, t0: float, stall_s: float, waited_s: float) -> None:
        if self.on_commit is not None:
            self.on_commit(PersistResult(step=step, dirs=[str(final_dir)], ok=True, stall_s=stall_s,
                                         durable_s=time.perf_counter() - t0, bytes=checkpoint_bytes(final_dir),
                                         waited_s=waited_s, done=[str(final_dir)]))
