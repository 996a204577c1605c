"""Tracker(run_dir, enabled).log(step, metrics): rank 0's experiment tracking.

Writes TensorBoard event files under runs/<name>/tensorboard/ and, when `trackio` is importable and asked for,
mirrors the scalars to a trackio project. `enabled=False` (other ranks, or tracking off) makes every call a no-op,
so the training loop calls it unconditionally. MFU is derived from tokens_per_s when the caller gives
flops_per_token and the peak FLOP/s of all devices together (see flops.py); a metrics dict that already holds
`mfu` wins.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

import numpy as np

from moe_launch.errors import ConfigError
from moe_launch.rundir import RunDir
from moe_launch.trainer.tracking.flops import mfu
from moe_launch.trainer.tracking.scalars import to_scalars

BACKENDS = ("tensorboard", "trackio")


def trackio_available() -> bool:
    return importlib.util.find_spec("trackio") is not None


class Tracker:
    def __init__(self, run_dir: str | Path | RunDir, enabled: bool = True, backends: tuple[str, ...] = ("tensorboard",),
                 flops_per_token: Optional[float] = None, peak_flops: Optional[float] = None,
                 project: str = "moe-launch"):
        root = run_dir.root if isinstance(run_dir, RunDir) else Path(run_dir)
        self.log_dir = root / "tensorboard"
        self.enabled = enabled
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self._tb = None
        self._trackio = None
        unknown = set(backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown tracking backends {sorted(unknown)}; known: {BACKENDS}")
        if not enabled:
            return
        if "tensorboard" in backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError("train.tensorboard", f"TensorBoard is not installed ({e})",
                                  "pip install tensorboard, or turn TensorBoard tracking off") from e
            self._tb = SummaryWriter(log_dir=str(self.log_dir))
        if "trackio" in backends:
            if not trackio_available():
                raise ConfigError("train.trackio", "trackio is not installed",
                                  "pip install trackio, or set train.trackio=false")
            import trackio

            trackio.init(project=project, name=root.name)
            self._trackio = trackio

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Log one step's metrics; returns the scalars written (empty when disabled)."""
        if not self.enabled:
            return {}
        metrics = dict(metrics)
        if "mfu" not in metrics and self.flops_per_token and "tokens_per_s" in metrics:
            value = mfu(float(metrics["tokens_per_s"]), self.flops_per_token, self.peak_flops)
            if value is not None:
                metrics["mfu"] = value
        scalars, hists = to_scalars(metrics)
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, step)
            for tag, values in hists.items():
                self._tb.add_histogram(tag, np.asarray(values, dtype=np.float64), step)
        if self._trackio is not None:
            self._trackio.log(scalars, step=step)
        return scalars

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._trackio is not None:
            self._trackio.finish()
            self._trackio = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
