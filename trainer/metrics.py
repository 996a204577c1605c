"""Step metrics (metrics.jsonl, optional TensorBoard, rich progress bar on rank 0) and per-rank heartbeats.

metrics.jsonl fields per logged step: step (completed optimizer steps), loss, lm_loss, aux_loss, z_loss (the
loss and its parts averaged over all data ranks; aux/z are the coefficient-weighted sums over layers), grad_norm
(global, before clipping), lr, tokens_per_s (global tokens over the wall time between this step's host sync and the
previous step's, so the previous update, logging and checkpoint writes count), expert_load_max / expert_load_mean
(per MoE layer, the busiest expert's pair count over the mean count on rank 0's tokens: 1.0 is
perfect balance; the max and the mean over layers), time (unix seconds), plus aux_per_layer / z_per_layer.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from moe_launch.errors import ConfigError
from moe_launch.rundir import RunDir, append_jsonl
from moe_launch.trainer.moe.losses import load_imbalance


def write_heartbeat(run_dir: RunDir, rank: int, step: int, host: str) -> None:
    """Whole-file replace without fsync: readers need an untorn file, not durability, and an fsync per step
    costs more than a tiny model's step on a busy disk."""
    path = run_dir.heartbeat / f"rank{rank}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"step": step, "time": time.time(), "host": host, "pid": os.getpid()}))
    os.replace(tmp, path)


class MetricsSink:
    """Rank 0's metric outputs. Other ranks do not create one."""

    def __init__(self, run_dir: RunDir, total_steps: int, start_step: int, tensorboard: bool, progress: bool):
        self.run_dir = run_dir
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError("train.tensorboard", f"TensorBoard is not installed ({e})",
                                  "pip install tensorboard, or set train.tensorboard=false") from e
            self.tb = SummaryWriter(log_dir=str(run_dir.root / "tensorboard"))
        self.progress = None
        if progress:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, record: dict[str, Any]) -> None:
        append_jsonl(self.run_dir.metrics, record)
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self.tb.add_scalar(f"train/{key}", value, record["step"])
        if self.progress is not None:
            info = f"loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s"
            self.progress.update(self.task, completed=record["step"], info=info)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.progress is not None:
            self.progress.stop()


def load_summary(counts_per_layer: list) -> tuple[Optional[float], Optional[float]]:
    """(max, mean) over MoE layers of max-count / mean-count. None for a dense model."""
    if not counts_per_layer:
        return None, None
    ratios = [float(load_imbalance(c)) for c in counts_per_layer]
    return max(ratios), sum(ratios) / len(ratios)
