"""Loss and gradient-norm spikes: detection against a robust running baseline, and what to do about one.

Every step the trainer hands `SpikeDetector.observe` the GLOBAL loss and the global gradient norm (both already
reduced over all ranks, so every rank sees the same numbers, keeps the same history and takes the same decision:
the ranks stay in lockstep without another collective). A value is a spike when

    value > median + train.spike.threshold * 1.4826 * MAD       over the last train.spike.window accepted steps

(1.4826 * MAD estimates the standard deviation of a normal distribution; the median and MAD ignore the spikes
themselves, which a mean and a standard deviation would not). Only upward spikes count, spikes never enter the
history, and nothing is judged before the window is full.

Actions (train.spike.action):
  skip      drop the update of that step (the data position and the schedule move on)
  rollback  exit with EXIT_ROLLBACK after writing `rollback.json` in the run directory: the relaunched trainer
            starts from the newest persistent model checkpoint before the spike, with a fresh optimizer at that
            checkpoint's step, and never reads the spike's batches again (rollback.json's `skips`)
  stop      exit with EXIT_SPIKE and a diagnosis
A spike that comes back after a rollback, before the step of the spike it rolled back from plus the window, is a
data/model problem (no node is to blame, and neither the fresh optimizer state nor skipping the spike's batches helped):
the trainer stops with EXIT_SPIKE.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Optional

from moe_launch.conf.schema import SpikeConfig
from moe_launch.rundir import write_json_atomic

MAD_TO_SIGMA = 1.4826
ROLLBACK_FILE = "rollback.json"
_MODEL_STEP = re.compile(r"model-step-(\d+)$")


@dataclass(frozen=True)
class Spike:
    step: int  # completed-step number (`done`) of the spiking step
    metric: str  # "loss" or "grad_norm"
    value: float
    median: float
    limit: float

    def describe(self) -> str:
        return (f"{self.metric} {self.value:.4g} at step {self.step} is above {self.limit:.4g} (median "
                f"{self.median:.4g} of the last steps)")


def spike_limit(history: list[float], threshold: float) -> tuple[float, float]:
    """(median, limit) of a window of accepted values. The MAD has a floor of a millionth of the median so that a
    window of identical values does not make every wobble a spike."""
    med = median(history)
    mad = median(abs(v - med) for v in history)
    mad = max(mad, 1e-6 * abs(med), 1e-12)
    return med, med + threshold * MAD_TO_SIGMA * mad


class SpikeDetector:
    def __init__(self, cfg: SpikeConfig, history: Optional[dict] = None):
        self.cfg = cfg
        h = history or {}
        self.loss = deque(h.get("loss", []), maxlen=cfg.window)
        self.grad_norm = deque(h.get("grad_norm", []), maxlen=cfg.window)

    def observe(self, done: int, loss: float, grad_norm: float) -> Optional[Spike]:
        """The first spiking metric of this step, or None (then both values join the history)."""
        for name, value, hist in (("loss", loss, self.loss), ("grad_norm", grad_norm, self.grad_norm)):
            if len(hist) == self.cfg.window:
                med, limit = spike_limit(list(hist), self.cfg.threshold)
                if value > limit:
                    return Spike(step=done, metric=name, value=value, median=med, limit=limit)
        self.loss.append(loss)
        self.grad_norm.append(grad_norm)
        return None

    def state_dict(self) -> dict:
        return {"loss": list(self.loss), "grad_norm": list(self.grad_norm)}


# -- rollback bookkeeping (rank 0 reads and writes rollback.json; the trainer broadcasts what it read) --------------
@dataclass(frozen=True)
class RollbackPlan:
    checkpoint: str  # the model-step-N directory the relaunched trainer starts from
    step: int  # N: the step it continues from (with a fresh optimizer)
    skip: tuple[int, int]  # [first, last] 0-based batch indices never read again


def model_checkpoint_before(checkpoints: Path, step: int) -> Optional[tuple[int, Path]]:
    """The newest complete model-step-N with N < step (a spike at step `step` happened after N), or None."""
    from moe_launch.trainer.checkpoint.store import verify  # the checkpoint package imports torch: keep it lazy

    found = []
    for p in checkpoints.glob("model-step-*"):
        m = _MODEL_STEP.search(p.name)
        if m and int(m.group(1)) < step:
            found.append((int(m.group(1)), p))
    for n, p in sorted(found, reverse=True):
        if verify(p)[0]:
            return n, p
    return None


def checkpoint_step(path: Path) -> int:
    """The step a (verified) checkpoint was written at, from its manifest."""
    from moe_launch.trainer.checkpoint.store import read_manifest

    return int(read_manifest(path)["step"])


def checkpoint_data_skips(path: Path) -> list[tuple[int, int]]:
    """The batches the run that wrote a model checkpoint had skipped by then (its manifest's meta)."""
    from moe_launch.trainer.checkpoint.store import read_manifest

    return [tuple(s) for s in (read_manifest(path) or {}).get("meta", {}).get("data_skips", [])]


def plan_rollback(batch_of_spike: int, skip_batches: int, newest_before: tuple[int, Path]) -> RollbackPlan:
    """Pure: restart from the newest model checkpoint before the spike; never read again the `skip_batches`
    batches that end with the spike's batch."""
    n, path = newest_before
    return RollbackPlan(checkpoint=str(path), step=n, skip=(max(0, batch_of_spike - skip_batches + 1), batch_of_spike))


@dataclass(frozen=True)
class SpikeVerdict:
    action: str  # what happens: skip | rollback | stop
    why: str  # the spike, and for a stop the diagnosis
    plan: Optional[RollbackPlan]  # rollback only


def judge_spike(spike: Spike, cfg: SpikeConfig, state: "RollbackState", start_step: int, batch_of_spike: int,
                newest_before: Optional[tuple[int, Path]]) -> SpikeVerdict:
    """Pure: what a spike that is not skipped leads to. `start_step`: where this attempt started (a rollback's
    restart step); `newest_before`: the newest complete model checkpoint before the spike, if any."""
    why = spike.describe()
    if cfg.action != "rollback":
        return SpikeVerdict("stop", why, None)
    earlier = state.recurs(spike.step, start_step, cfg.window)
    if earlier is not None:
        return SpikeVerdict("stop", f"{why}; it recurs after the rollback from the spike at step {earlier}: a "
                            "data/model problem, not a node problem (lower train.lr, raise train.spike.skip_batches, "
                            "or inspect the data near this step)", None)
    if newest_before is None:
        return SpikeVerdict("stop", f"{why}; no persistent model checkpoint before it to roll back to (set "
                            "train.model_ckpt_interval)", None)
    return SpikeVerdict("rollback", why, plan_rollback(batch_of_spike, cfg.skip_batches, newest_before))


def rollback_applies(pending: Optional[dict], slot_captured: Optional[float]) -> bool:
    """A pending rollback decides where the trainer starts until a full checkpoint whose state was captured after it
    exists (`slot_captured`: the `time` in the newest slot's trainer state, taken when the step's state was
    snapshotted, not when a background write finished): that checkpoint already continues the rolled-back run."""
    if pending is None:
        return False
    return slot_captured is None or slot_captured < float(pending["time"])


def batch_for_step(step: int, skips: list[tuple[int, int]]) -> int:
    """0-based batch index that 0-based step `step` reads when the batches of `skips` (inclusive [first, last]
    ranges) are never read: steps map onto the remaining batches in order. Pure."""
    merged: list[list[int]] = []
    for first, last in sorted(skips):  # windows of later rollbacks may overlap earlier ones
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    batch = step
    for first, last in merged:
        if batch >= first:
            batch += last - first + 1
    return batch


@dataclass
class RollbackState:
    """rollback.json: the data windows skipped for good, the pending restart (until the first full checkpoint after
    it exists) and the spikes that caused rollbacks."""

    skips: list[tuple[int, int]]
    pending: Optional[dict]  # {"checkpoint", "step", "time", "history"} of the latest rollback (rollback_applies)
    spikes: list[int]  # spike steps that were rolled back from

    @classmethod
    def read(cls, run_root: Path) -> "RollbackState":
        path = run_root / ROLLBACK_FILE
        data = json.loads(path.read_text()) if path.exists() else {}
        return cls(skips=[tuple(s) for s in data.get("skips", [])], pending=data.get("pending"),
                   spikes=list(data.get("spikes", [])))

    def write(self, run_root: Path) -> None:
        write_json_atomic(run_root / ROLLBACK_FILE, {"skips": [list(s) for s in self.skips], "pending": self.pending,
                                                     "spikes": self.spikes})

    def recurs(self, spike_step: int, restart_step: int, window: int) -> Optional[int]:
        """The earlier spike this one repeats (a spike within `window` steps after one that was rolled back from,
        in a run restarted before it), or None."""
        for s in self.spikes:
            if restart_step < s and spike_step <= s + window:
                return s
        return None

    def with_rollback(self, plan: RollbackPlan, spike_step: int, now: float, history: dict) -> "RollbackState":
        """`history`: the detector's window before the spike, which the restarted run starts from."""
        return RollbackState(skips=sorted({*self.skips, plan.skip}),
                             pending={"checkpoint": plan.checkpoint, "step": plan.step, "time": now,
                                      "history": history},
                             spikes=[*self.spikes, spike_step])
