"""Experiment tracking on rank 0: TensorBoard (and trackio when it is importable) fed from the step metrics dicts.

  scalars.py  metrics dict -> named scalars and histograms (pure)
  flops.py    model FLOPs per token and MFU (pure)
  tracker.py  Tracker(run_dir, enabled).log(step, metrics): the writers
"""

from moe_launch.trainer.tracking.tracker import Tracker

__all__ = ["Tracker"]
