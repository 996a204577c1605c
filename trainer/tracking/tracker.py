"""Tracker(run_dir, backends).log(step, metrics): rank 0's experiment tracking, fed from the metrics.jsonl records.

Backends (`train.tracking`):
  tensorboard  event files under runs/<name>/tensorboard/ (on by default; a missing package is a warning, not a
               failed run: the run's own metrics.jsonl and `moe-launch report` do not need it)
  wandb        a W&B run named after the run directory, its files under runs/<name>/wandb/; WANDB_MODE=offline
               (W&B's own switch) keeps it local. Asked for explicitly, so a missing package is a config error.
The trainer puts every derived value (MFU, expert counts) into the record; this file only maps names
(scalars.py) and writes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from moe_launch.errors import ConfigError
from moe_launch.rundir import RunDir
from moe_launch.trainer.tracking.scalars import to_scalars

BACKENDS = ("tensorboard", "wandb")
log = logging.getLogger("moe_launch.trainer")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_backends(backends: Sequence[str]) -> list[str]:
    """The backends that will run. Raises ConfigError for an unknown name or an explicitly chosen W&B that is not
    installed; drops TensorBoard with a warning when its package is missing."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError("train.tracking", f"unknown backends {unknown}", f"use a list of {', '.join(BACKENDS)}")
    if "wandb" in backends and not installed("wandb"):
        raise ConfigError("train.tracking", "wandb is listed but not installed",
                          "pip install wandb (WANDB_MODE=offline needs no account), or drop wandb from train.tracking")
    chosen = list(dict.fromkeys(backends))
    if "tensorboard" in chosen and not installed("tensorboard"):
        log.warning("TensorBoard is not installed: no event files (pip install tensorboard, or set "
                    "train.tracking=[] to silence this)")
        chosen.remove("tensorboard")
    return chosen


class Tracker:
    def __init__(self, run_dir: str | Path | RunDir, backends: Sequence[str] = ("tensorboard",),
                 config: Optional[dict[str, Any]] = None, project: str = "moe-launch"):
        root = run_dir.root if isinstance(run_dir, RunDir) else Path(run_dir)
        self.log_dir = root / "tensorboard"
        self.backends = check_backends(backends)
        self._tb = None
        self._wandb = None
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.log_dir))
        if "wandb" in self.backends:
            import wandb

            (root / "wandb").mkdir(parents=True, exist_ok=True)
            # an id from the run directory's path with resume="allow": a restarted attempt continues the same W&B
            # run, and two runs that share a name (runs/a/x, runs/b/x) do not
            run_id = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:16]
            self._wandb = wandb.init(project=project, name=root.name, id=run_id, resume="allow", dir=str(root),
                                     config=config or {})

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Log one step's metrics; returns the scalars written."""
        scalars, hists = to_scalars(metrics)
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, step)
            for tag, values in hists.items():
                self._tb.add_histogram(tag, np.asarray(values, dtype=np.float64), step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        return scalars

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            # finish() can return before W&B's service has written the run's file (seen offline: only the header
            # was on disk); teardown waits for it. A later wandb.init in this process sets the service up again.
            wandb.teardown()
            self._wandb = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
