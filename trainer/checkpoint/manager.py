"""The trainer's checkpoints: dual slots written asynchronously, persistent model-only checkpoints, the journal
records, and the decision to stop when persisting keeps failing.

    ckpt = CheckpointManager(...)            # after the resume: knows the newest valid slot
    ckpt.fence()                             # before every optimizer update (GPU-side wait for the snapshot copy)
    stop = ckpt.save(done, full, model_only, state)   # at a step end; `state(rels)` builds the device state
    stop = ckpt.finish()                     # before exiting (normal end, preemption, time limit, soft fault)

`save` waits for the previous persist, takes its outcome (newest slot on success; a failure is counted), captures
the state and returns at once; the write goes on in the background (checkpoint/persist.py). The full checkpoint
goes into `next_slot(newest valid slot)`, so the slot being written is never the newest valid one, and no two
writers ever share a slot (one persist at a time). After MAX_FAILED_PERSISTS failed persists in a row `save` /
`finish` return a stop reason: the trainer then exits with EXIT_CHECKPOINT_WRITE.

Journal (rank 0, written by the background thread when the persist ends): `checkpoint` records with slot, step,
stall_s (training blocked), durable_s (request -> manifest renamed into place), bytes (all ranks' files), waited_s
(part of the stall spent waiting for the previous persist); a failed persist: `checkpoint` with failed=true, the
path and the error (the older slot untouched).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from moe_launch.rundir import RunDir, journal_event
from moe_launch.trainer.checkpoint.persist import AsyncCheckpointer, PersistResult, Target, checkpoint_comm
from moe_launch.trainer.checkpoint.state import FileNames, file_object
from moe_launch.trainer.checkpoint.store import next_slot
from moe_launch.trainer.tracking.steplog import LOGGER

log = logging.getLogger(LOGGER)
SLOW_STALL_S = 1.0  # a checkpoint that blocks training longer than this says how to avoid it (once per process)
MAX_FAILED_PERSISTS = 2  # in a row; one failure can be a transient (a full scratch disk cleaned up meanwhile)


def persist_failure_reason(failures: list[PersistResult], final: bool = False) -> Optional[str]:
    """Why to stop after these consecutive failed persists (None: keep training). `final`: no later checkpoint
    will be tried (the run is exiting), so one failure is enough. Pure."""
    if not failures or (len(failures) < MAX_FAILED_PERSISTS and not final):
        return None
    last = failures[-1]
    return (f"{len(failures)} checkpoints in a row could not be written (last: {last.error_path}: {last.error}); "
            "the newest valid checkpoint is older. Fix the checkpoint file system (space, permissions, health) "
            "and resume")


class CheckpointManager:
    def __init__(self, run_dir: RunDir, device: torch.device, files: FileNames, writes: Callable[[bool], list[str]],
                 newest_slot: Optional[str], last_step: int, leader: bool, model_meta: dict,
                 kill_hook: Callable[[int], Optional[Callable[[], None]]]):
        """`writes(model_only)`: this rank's relpaths of a full (False) or model-only (True) checkpoint.
        `kill_hook(step)`: fault injection inside the full checkpoint of that step (None: none)."""
        self.run_dir, self.files, self.writes, self.leader = run_dir, files, writes, leader
        self.newest_slot, self.last_step = newest_slot, last_step  # the newest durable full checkpoint
        self.requested_step = last_step  # the newest full checkpoint requested (maybe still persisting)
        self.model_meta, self.kill_hook = model_meta, kill_hook
        self.failures: list[PersistResult] = []
        self.writer = AsyncCheckpointer(device, checkpoint_comm(device), self._journal,
                                        on_commit=self._journal_commit)
        self._pending_slot: Optional[str] = None
        self._warned_stall = False

    @property
    def pinned_bytes(self) -> int:
        return self.writer.snapshot.nbytes

    def reserve(self, full: bool, model_only: bool, state: Callable[[list[str]], dict[str, Any]]) -> None:
        """Allocate the host buffers of the checkpoints this run will take, in the background (see
        HostSnapshot.reserve); `state` as for `save`."""
        rels = (self.writes(False) if full else []) + (self.writes(True) if model_only else [])
        if rels:
            self.writer.snapshot.reserve(state(list(dict.fromkeys(rels))))

    def fence(self) -> None:
        self.writer.fence()

    @property
    def persisting(self) -> bool:
        return self.writer.busy

    def save(self, done: int, full: bool, model_only: bool, state: Callable[[list[str]], dict[str, Any]],
             position: Optional[dict] = None) -> Optional[str]:
        """Start the checkpoints due at step `done`; a stop reason if persisting keeps failing. `position`: what a
        model-only checkpoint records beside the model config (data position and schedule at `done`)."""
        t0 = time.perf_counter()
        reason = self._absorb(self.writer.wait())
        if reason is not None or not (full or model_only):
            return reason
        targets, rels = [], []
        # the model-only checkpoint is written first: a relaunch resumes from the newest valid slot and does not redo
        # its step, so a process lost after the slot's commit would leave the model checkpoint of that step unwritten
        if model_only:
            model_rels = self.writes(True)
            targets.append(Target(self.run_dir.checkpoints / f"model-step-{done}", self._builders(model_rels),
                                  meta={"model": self.model_meta, **(position or {})}, model_only=True))
            rels += model_rels
        if full:
            slot = next_slot(self.newest_slot)
            full_rels = self.writes(False)
            targets.append(Target(self.run_dir.checkpoints / slot, self._builders(full_rels),
                                  after_shards=self.kill_hook(done)))
            rels += [r for r in full_rels if r not in rels]
            self._pending_slot, self.requested_step = slot, done
        stall_s, _ = self.writer.request(done, targets, state(rels), since=t0)
        if stall_s > SLOW_STALL_S and self.leader and not self._warned_stall:
            self._warned_stall = True
            log.warning(f"the checkpoint of step {done} blocked training for {stall_s:.1f} s, waiting for the previous "
                        "one to be written; raise train.ckpt_interval above the time a checkpoint takes to become "
                        "durable (journal: durable_s), or set train.ckpt_when_busy=skip")
        return None

    def finish(self) -> Optional[str]:
        """Before exiting: wait until the in-flight persist is durable (or failed), release the writer; a stop
        reason if that persist failed."""
        try:
            self._absorb(self.writer.wait())
        finally:
            self.writer.close()
        return persist_failure_reason(self.failures, final=True)

    def finish_quietly(self) -> None:
        """`finish` on the way out of a crash: the crash is the error to report, not the checkpoint's."""
        try:
            self.finish()
        except Exception as e:  # a lost peer fails the writers' collectives too
            log.warning(f"the checkpoint in flight at the crash did not complete: {e}")

    def _builders(self, rels: list[str]) -> dict[str, Callable[[dict], Any]]:
        return {rel: file_object(rel, self.files, self.writer.snapshot.scratch) for rel in rels}

    def _absorb(self, result: Optional[PersistResult]) -> Optional[str]:
        if result is None:
            return None
        slot, self._pending_slot = self._pending_slot, None
        if result.ok:
            self.failures = []
            if slot is not None:
                self.newest_slot, self.last_step = slot, result.step
            return None
        self.failures.append(result)
        return persist_failure_reason(self.failures)

    def _journal_commit(self, r: PersistResult) -> None:
        """Runs in the background thread on rank 0 the moment a checkpoint directory is valid (a peer may still be
        lost before the persist ends: the checkpoint stays valid and resumable, so it is recorded here)."""
        if not self.leader:
            return
        for d in r.done:
            name = Path(d).name
            extra = {"model_only": True} if name.startswith("model-") else {}
            journal_event(self.run_dir, "checkpoint", [], slot=name, step=r.step, stall_s=round(r.stall_s, 4),
                          durable_s=round(r.durable_s, 3), waited_s=round(r.waited_s, 3), bytes=r.bytes,
                          pinned_bytes=self.pinned_bytes, scratch_bytes=self.writer.snapshot.scratch_bytes, **extra)

    def _journal(self, r: PersistResult) -> None:
        """Runs in the background thread when a persist ends (every rank; rank 0 writes its failure)."""
        if not self.leader:
            return
        if not r.ok:
            journal_event(self.run_dir, "checkpoint", [], failed=True, step=r.step, path=r.error_path,
                          error=r.error, durable_s=round(r.durable_s, 3))
