"""How a Trainer starts from saved state: the newest valid dual slot, else a model-only checkpoint
(model.init_from=ckpt:... or a spike rollback), else an HF checkpoint (model.init_from=hf:...), else the fresh init.

A mixin of trainer/loop.py's Trainer (it reads the Trainer's groups, coordinates, model and optimizer):

    resume = self._choose_resume(verify_first)  # rank 0 picks the slot, every rank gets the choice
    start_step = self._load_model()       # weights (read by one DP member per replica group, then broadcast)
    ...                                   # parameters cast, optimizer built
    self._load_optimizer_and_rng(path)    # the exact fp32 masters and moments, the RNG states
    self._confirm_resume()                # rank 0's digest check passed, or every rank raises UnverifiedResume

The digest check of the newest slot runs while the slot is being loaded (the loads then read pages the check has
just brought in, so the disk reads each byte once and the restore costs about one read of the checkpoint). Nothing
loaded is used before the check passed: when it fails, every rank raises UnverifiedResume at _confirm_resume and the
trainer is built again with verify_first=True, which checks the slots before reading any (the older one then).

A resume under another DP size or optimizer sharding reshards the optimizer (checkpoint/resume.py); under another EP
size or PP split the model and optimizer are reassembled by parameter name (checkpoint/relayout.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_launch.errors import CheckpointError, ConfigError
from moe_launch.rundir import journal_event, read_jsonl
from moe_launch.trainer.checkpoint import relayout
from moe_launch.trainer.checkpoint import state as ckpt_state
from moe_launch.trainer.checkpoint.resume import load_optimizer_resharded, resume_mode
from moe_launch.trainer.checkpoint.store import PendingResume, SlotChoice, choose_resume_slot, read_manifest
from moe_launch.trainer.host_restore import is_held
from moe_launch.trainer.interop.hf import hf_path, hf_state_for_rank, load_hf_into_model
from moe_launch.trainer.parallel.broadcast import broadcast_model
from moe_launch.trainer.spike import checkpoint_data_skips, checkpoint_step

_SHORT = {"float32": "fp32", "bfloat16": "bf16"}  # torch's dtype names -> train.param_dtype values


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class UnverifiedResume(Exception):
    """The slot being loaded failed its digest check (raised on every rank, at the same point)."""


class Restore:
    def _choose_resume(self, verify_first: bool) -> SlotChoice:
        """Rank 0 picks the slot and tells the others: the newest with a manifest, checked while it loads, or with
        `verify_first` the newest that verifies (every file read once before any load)."""
        self._pending_resume: Optional[PendingResume] = None
        self._resume_record: Optional[dict] = None
        choice = None
        if self.rank == 0:
            if verify_first:
                choice = choose_resume_slot(self.run_dir.checkpoints, skip=self._slots_rejected_before())
            else:
                self._pending_resume = PendingResume(self.run_dir.checkpoints, skip=self._slots_rejected_before(),
                                                     on_reject=self._journal_rejection)
                choice = self._pending_resume.choice
        choice = self.comm.broadcast_object(choice)
        if self.rank == 0 and choice.rejected:
            for slot, reason in choice.rejected.items():
                print(f"[trainer] checkpoint {slot} rejected: {reason}", flush=True)
        return choice

    def _journal_rejection(self, slot: str, step: int, reason: str) -> None:
        """From the check's thread: recorded at once, so that a relaunch skips the slot even when this process
        never gets to _confirm_resume (a load error on another rank ends the job first)."""
        journal_event(self.run_dir, "info", self.hosts[:1], checkpoint_rejected=slot, manifest_step=step,
                      reason=reason, attempt=self.attempt)

    def _slots_rejected_before(self) -> dict[str, str]:
        """{slot: why} for the slots an earlier attempt's check rejected that still hold the same checkpoint."""
        bad = {}
        for record in read_jsonl(self.run_dir.journal):
            d = record.get("details", {})
            if record.get("kind") != "info" or "checkpoint_rejected" not in d:
                continue
            manifest = read_manifest(self.run_dir.checkpoints / d["checkpoint_rejected"])
            if manifest is not None and manifest.get("step") == d.get("manifest_step"):
                bad[d["checkpoint_rejected"]] = f"rejected by attempt {d.get('attempt')}: {d.get('reason')}"
        return bad

    def _explain_load_error(self) -> None:
        """A load from a slot still being checked raised. In a world of one, a failed check makes it a fall-back
        (UnverifiedResume); with more ranks the peers sit in collectives this rank will not join, so the error ends
        the job and the relaunch skips the slot (the check journaled its rejection)."""
        if self._pending_resume is None or self.resume.path is None:
            return
        ok, reason = self._pending_resume.confirm()
        if not ok and self.groups.world_size == 1:
            print(f"[trainer] checkpoint {self.resume.path.name} rejected while loading: {reason}", flush=True)
            raise UnverifiedResume(reason)

    def _confirm_resume(self) -> None:
        """Collective: after every load from the slot, before anything runs on what was loaded."""
        if self._pending_resume is None or self.resume.path is None:  # nothing checked, or nothing loaded from it
            verdict = (True, "ok")
        else:
            verdict = self._pending_resume.confirm()
        ok, reason = self.comm.broadcast_object(verdict if self.rank == 0 else None)
        if not ok:
            if self.rank == 0:
                print(f"[trainer] checkpoint {self.resume.path.name} rejected after loading: {reason}", flush=True)
            raise UnverifiedResume(reason)
        if self.rank == 0 and self._resume_record is not None:
            journal_event(self.run_dir, "resume", self.hosts[:1], **self._resume_record)

    def _load_model(self) -> int:
        """Weights from the resume slot, else from model.init_from=ckpt:..., else the fresh init (identical on every
        rank by construction). Returns the first step to run."""
        if self.resume.path is not None:
            saved = ckpt_state.load_trainer_state(self.resume.path)
            # CheckpointError unless at most parallel.dp / optimizer_sharding changed (the model files do not
            # depend on them; the optimizer shards are reassembled in _load_optimizer_and_rng)
            self._check_param_dtype(saved.get("param_dtype"))
            self.saved_layout = saved["layout"]
            self.resume_mode = resume_mode(self.saved_layout, self._layout())
            self._load_and_broadcast(self.resume.path)
            # journaled by _confirm_resume, once the slot's digest check passed
            self._resume_record = dict(checkpoint=str(self.resume.path), slot=self.resume.path.name, step=saved["step"],
                                       fell_back=self.resume.fell_back, rejected=self.resume.rejected,
                                       attempt=self.attempt, from_memory=is_held(self.resume.path),
                                       resharded=self.resume_mode != "same")
            return int(saved["step"])
        init_from = self.cfg.model.init_from
        if self.rollback.pending is not None:
            init_from = f"ckpt:{self.rollback.pending['checkpoint']}"
        if init_from is not None and init_from.startswith("ckpt:"):
            # a model-only checkpoint continues at its step: the schedule and the data position are functions of
            # the step (and of rollback.json's skipped batches); only the optimizer starts afresh
            path = ckpt_state.verified_model_dir(init_from)
            self._load_and_broadcast(path)
            self.restart_step = checkpoint_step(path)
            # the checkpoint's run may have skipped batches (spike rollbacks): continue its step -> batch map
            self.rollback.skips = sorted({*self.rollback.skips, *checkpoint_data_skips(path)})
            if self.rank == 0:
                journal_event(self.run_dir, "resume", self.hosts[:1], checkpoint=str(path), model_only=True,
                              fresh_optimizer=True, step=self.restart_step, attempt=self.attempt,
                              rollback=self.rollback.pending is not None)
            return self.restart_step
        elif init_from is not None:  # hf:/path, an OLMoE-format save_pretrained directory
            if self.groups.dp_rank == 0:
                self._load_hf(hf_path(init_from))
            broadcast_model(self.model, self.groups)
            if self.rank == 0:
                journal_event(self.run_dir, "resume", self.hosts[:1], checkpoint=init_from, model_only=True,
                              fresh_optimizer=True, step=0, attempt=self.attempt)
        return 0

    def _check_param_dtype(self, saved: Optional[str]) -> None:
        """The optimizer's state is bucketed by parameter dtype, so a full resume needs the saved one (checkpoints of
        older versions do not say: fp32 parameters then, and a mismatch surfaces as a bucket error)."""
        mine = dtype_name(self.param_dtype)
        if saved is not None and saved != mine:
            raise ConfigError("train.param_dtype", f"{self.resume.path} was written with {saved} parameters, this run "
                              f"has {mine}", f"resume with train.param_dtype={_SHORT[saved]}, or start from its "
                              "weights with a fresh optimizer (model.init_from=ckpt:<a model-step-N checkpoint>)")

    def _load_and_broadcast(self, path) -> None:
        """Only the first DP member of each (stage, EP rank) reads the files; the others receive the weights.
        A model-only checkpoint may come from a run with another parallel.pp: load_model reads stage-sharded and
        unpipelined files alike (the parameter names are the full model's in both)."""
        if self.groups.dp_rank == 0:
            if self.resume_mode == "relayout":  # another EP size or PP split: reassembled by parameter name
                relayout.load_model(path, self.model, self.groups.ep_rank, self.groups.ep_size)
            else:
                ckpt_state.load_model(path, self.coords, self.model)
        broadcast_model(self.model, self.groups)

    def _load_optimizer_and_rng(self, path) -> None:
        if self.resume_mode in ("reshard", "relayout"):
            if self.resume_mode == "reshard":
                load_optimizer_resharded(path, self.optimizer, self.saved_layout)
            else:
                relayout.load_optimizer(path, self.optimizer, self.saved_layout)
            # the saved RNG states belong to the ranks of another world; nothing in a step draws random numbers
            # (init has its own generators), so the losses do not depend on them
            return
        ckpt_state.load_optimizer(path, self.coords, self.optimizer, self.groups)  # replicated: read once per DP group
        ckpt_state.load_rng(path, self.coords, self.device)

    def _load_hf(self, path) -> None:
        if self.pipeline is None:
            load_hf_into_model(self.model, path, self.groups.ep_rank, self.groups.ep_size)
            return
        # a stage takes its names out of the whole model's state (same names, see trainer/pipeline/stage.py)
        sd = hf_state_for_rank(path, self.cfg.model, self.groups.ep_rank, self.groups.ep_size)
        want = self.model.state_dict().keys()
        missing = sorted(set(want) - sd.keys())
        if missing:
            raise CheckpointError(f"{path}: parameters {missing[:4]} of pipeline stage {self.groups.pp_rank} are not "
                                  "in the HF checkpoint; check model.* against its config.json")
        self.model.load_state_dict({k: sd[k] for k in want}, strict=True)

    def _layout(self) -> dict:
        p = self.cfg.parallel
        return {"dp": p.dp, "ep": p.ep, "pp": p.pp, "optimizer_sharding": p.optimizer_sharding,
                "world_size": self.groups.world_size}
