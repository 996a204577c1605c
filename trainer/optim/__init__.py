"""Learning-rate schedules and the optimizer entry. The AdamW itself (replicated, ZeRO-1, EPSO) lives in
trainer/parallel/optimizer.py; this package decides WHAT learning rate and clipping each step uses."""

from moe_launch.trainer.optim.schedule import clip_norm_at, lr_at, rewarmup_factor

__all__ = ["lr_at", "clip_norm_at", "rewarmup_factor"]
