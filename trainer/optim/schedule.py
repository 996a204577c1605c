"""Learning-rate schedules as pure functions of the 0-based optimizer step.

  warm-up   linear from lr/warmup_steps to lr over the first `warmup_steps` steps (step i uses lr*(i+1)/warmup)
  cosine    then half a cosine from lr to min_lr, reaching min_lr at the last step (Optimus: 4e-4 -> 4e-5)
  wsd       warm-up, stable at lr, then a linear decay to min_lr over the last `wsd_decay_fraction` of the steps
  constant  warm-up, then lr
"""

from __future__ import annotations

import math

from moe_launch.conf.schema import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    last = cfg.steps - 1
    if cfg.schedule == "cosine":
        span = max(1, last - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    decay_start = max(cfg.warmup_steps, cfg.steps - round(cfg.wsd_decay_fraction * cfg.steps))
    if step < decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start) / max(1, last - decay_start))
    return cfg.lr + (cfg.min_lr - cfg.lr) * progress


def clip_norm_at(step: int, cfg: TrainConfig) -> float:
    """Clipping threshold for this step; 0 means no clipping (the norm is still measured and checked)."""
    if cfg.clip_after_warmup_only and step < cfg.warmup_steps:
        return 0.0
    return cfg.grad_clip


def rewarmup_factor(step: int, restart_step: int | None, rewarmup_steps: int) -> float:
    """Multiplier of the scheduled learning rate after a start from a model-only checkpoint at `restart_step` (a
    fresh optimizer has no moment estimates yet): linear from 1/rewarmup_steps to 1 over the first steps of the
    restarted run; 1 otherwise."""
    if restart_step is None or rewarmup_steps == 0 or step >= restart_step + rewarmup_steps:
        return 1.0
    return (step - restart_step + 1) / rewarmup_steps
