"""A Trainer's checkpoints at step ends: the dual slots and model-only checkpoints through the CheckpointManager
(trainer/checkpoint/manager.py, written in the background), what goes into trainer.pt, skipping a checkpoint due
while the previous one still persists (train.ckpt_when_busy=skip), and the stop when persisting keeps failing.

A mixin of trainer/loop.py's Trainer (it reads the Trainer's model, optimizer, loader and run directory).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Optional

from moe_launch.rundir import EXIT_CHECKPOINT_WRITE, EXIT_OK, journal_event
from moe_launch.trainer import faults
from moe_launch.trainer.checkpoint import layout as ckpt_layout
from moe_launch.trainer.checkpoint.manager import CheckpointManager
from moe_launch.trainer.checkpoint.state import FileNames, device_state
from moe_launch.trainer.optim import lr_at
from moe_launch.trainer.restore import dtype_name
from moe_launch.trainer.tracking.steplog import LOGGER

log = logging.getLogger(LOGGER)


class Checkpointing:
    def _trainer_state(self, done: int) -> dict:
        return {"step": done, "data": self.loader.state_dict(), "layout": self._layout(),
                "model": asdict(self.cfg.model), "param_dtype": dtype_name(self.param_dtype), "time": time.time(),
                "spike_history": self.spikes.state_dict() if self.spikes is not None else None}

    def _kill_hook(self, done: int):
        if self.injection == "kill_during_ckpt" and done >= self.cfg.train.fault_injection.step:
            return faults.sigkill_self
        return None

    def _checkpoint_manager(self) -> CheckpointManager:
        """The dual slots and model checkpoints of this rank's files (trainer/checkpoint/layout.py), written
        asynchronously."""
        files, writes = FileNames.of(self.coords), (lambda m: ckpt_layout.writes(self.coords, model_only=m))
        newest = self.resume.path.name if self.resume.path is not None else None
        manager = CheckpointManager(self.run_dir, self.device, files, writes, newest, self.start_step, self.rank == 0,
                                    asdict(self.cfg.model), self._kill_hook)
        t = self.cfg.train  # the host buffers are pinned in the background while the first steps run

        def reserve() -> None:
            manager.reserve(bool(t.ckpt_interval), bool(t.model_ckpt_interval), lambda rels: device_state(
                rels, files, self.model, self.optimizer, self._trainer_state(self.start_step), self.device))

        # pinning holds the CUDA driver for seconds: a cold start overlaps it with compiling (host work); a warm
        # standby's first step is the recovery's last phase, so there it starts once that step is done
        self._reserve_after_first_step = reserve if self.prebuilt else None
        if not self.prebuilt:
            reserve()
        return manager

    def _save_checkpoints(self, done: int, full: bool, model_only: bool) -> Optional[int]:
        """Snapshot now, persist in the background; EXIT_CHECKPOINT_WRITE once persisting keeps failing."""
        reason = self.ckpt.save(done, full, model_only, lambda rels: device_state(
            rels, self.ckpt.files, self.model, self.optimizer, self._trainer_state(done), self.device),
            position=self._position(done) if model_only else None)
        self.heartbeat.beat(done)  # waiting for a slow persist is no hang
        return None if reason is None else self._stop_checkpoint_write(done, reason)

    def _skip_checkpoint(self, done: int) -> bool:
        """train.ckpt_when_busy=skip: the previous checkpoint was still being written on some rank when this step's
        verdict was reduced, so every rank skips this one (returns False: no full checkpoint now)."""
        if self.rank == 0:
            journal_event(self.run_dir, "info", [], message=f"checkpoint of step {done} skipped: the previous one "
                          f"(step {self.ckpt.requested_step}) is still being written", skipped_checkpoint=done)
        return False

    def _position(self, done: int) -> dict:
        """Where a run restarted from this step's model checkpoint continues: the data position (and the batches
        skipped so far, which fix the step -> batch map) and the schedule (the learning rate of the next step)."""
        t = self.cfg.train
        return {"step": done, "data": self.loader.state_dict(), "data_skips": [list(s) for s in self.rollback.skips],
                "schedule": {"schedule": t.schedule, "lr": t.lr, "min_lr": t.min_lr, "warmup_steps": t.warmup_steps,
                             "steps": t.steps, "next_lr": lr_at(done, t)}}

    def _finish_checkpoints(self, code: int) -> int:
        """Wait until the in-flight checkpoint is durable before exiting with `code`."""
        reason = self.ckpt.finish()
        if reason is not None and code == EXIT_OK:
            return self._stop_checkpoint_write(self.ckpt.last_step, reason)
        return code

    def _stop_checkpoint_write(self, done: int, reason: str) -> int:
        if self.rank == 0:
            log.error(reason)
            journal_event(self.run_dir, "stop", self.hosts, reason="checkpoint_write", step=done, what=reason,
                          checkpoint=self.ckpt.newest_slot)
        return EXIT_CHECKPOINT_WRITE
