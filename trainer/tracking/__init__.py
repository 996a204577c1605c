"""Experiment tracking on rank 0: TensorBoard (on by default) and W&B, fed from the step metrics records.

  scalars.py  metrics dict -> named scalars and histograms (pure)
  flops.py    model FLOPs per token, MFU, a device's peak FLOP/s (data sheet, preflight-measured GEMM) (pure)
  steplog.py  the plain step log line (Python logging, rank/node prefix)
  tracker.py  Tracker(run_dir, backends).log(step, metrics): the writers
"""

from moe_launch.trainer.tracking.tracker import Tracker

__all__ = ["Tracker"]
