"""Step metrics on rank 0: metrics.jsonl, the plain log line (tracking/steplog.py), tracking backends (TensorBoard by
default, W&B; tracking/tracker.py), rich's progress bar on a terminal.

metrics.jsonl fields per logged step: step (completed optimizer steps), loss, lm_loss, aux_loss, z_loss (the
loss and its parts averaged over all data ranks; aux/z are the coefficient-weighted sums over layers), grad_norm
(global, before clipping), lr, tokens_per_s (global tokens over the wall time between this step's host sync and the
previous step's, so the previous update, logging and checkpoint writes count), step_time_s (that interval),
expert_counts [L][E] ((token, slot) pairs per expert of each MoE layer, summed over every data rank's micro-batches
of the step: all ranks' tokens, not rank 0's), expert_load_max / expert_load_mean (per MoE layer the busiest
expert's count over the mean count, 1.0 = perfect balance; the max and the mean over layers), mfu (model FLOPs over
the devices' data-sheet peak: bf16, or with FP8 experts the peak of the step's mix of bf16 and FP8 FLOPs,
tracking/flops.py step_peak; or train.peak_flops), mfu_gemm (over the GEMM rate the preflight compute check measured
on these nodes), mem_gib (peak allocated device memory on CUDA, resident set size on CPU), time (unix seconds), plus
aux_per_layer / z_per_layer. Under pipeline parallelism the per-layer fields cover rank 0's stage.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from moe_launch.rundir import RunDir, append_jsonl
from moe_launch.trainer.moe.losses import load_imbalance
from moe_launch.trainer.tracking.flops import measured_gemm_rate
from moe_launch.trainer.tracking.steplog import LOGGER, format_step_line
from moe_launch.trainer.tracking.tracker import Tracker

log = logging.getLogger(LOGGER)


@dataclass(frozen=True)
class PerfRefs:
    """What MFU is measured against: model FLOPs per token, and the FLOP/s of one device (data-sheet peak, preflight
    GEMM rate; None when unknown) times the number of devices."""

    flops_per_token: float
    devices: int
    spec_peak: Optional[float] = None
    gemm_rate: Optional[float] = None

    def mfu(self, tokens_per_s: float) -> tuple[Optional[float], Optional[float]]:
        used = tokens_per_s * self.flops_per_token
        return tuple(used / (self.devices * ref) if ref else None for ref in (self.spec_peak, self.gemm_rate))


def preflight_gemm_rate(run_dir: RunDir, hosts: Sequence[str]) -> Optional[float]:
    """The measured per-device GEMM rate of `hosts` from the run's newest preflight (health/preflight.json)."""
    path = Path(run_dir.health) / "preflight.json"
    try:
        return measured_gemm_rate(json.loads(path.read_text()), hosts)
    except (OSError, ValueError):
        return None


class MetricsSink:
    """Rank 0's metric outputs. Other ranks do not create one."""

    def __init__(self, run_dir: RunDir, total_steps: int, start_step: int, tracking: Sequence[str], progress: bool,
                 config: Optional[dict[str, Any]] = None):
        self.run_dir, self.total_steps = run_dir, total_steps
        self.tracker = Tracker(run_dir, tracking, config=config)
        self.progress = None
        # the bar only where someone watches: in a batch log it is one stale line; the log lines carry the numbers
        if progress and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, record: dict[str, Any]) -> None:
        # metrics.jsonl is data (the supervisor, report and goodput read it back), not a log stream: one flushed
        # JSON line per record, the same writer as the journal; the human line goes through logging below
        append_jsonl(self.run_dir.metrics, record)
        self.tracker.log(record["step"], record)
        log.info(format_step_line(record, self.total_steps))
        if self.progress is not None:
            info = f"loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s"
            self.progress.update(self.task, completed=record["step"], info=info)

    def log_eval(self, record: dict[str, Any]) -> None:
        """A held-out evaluation (trainer/evaluate.py): eval.jsonl, not metrics.jsonl, whose readers expect steps."""
        from moe_launch.trainer.evaluate import format_eval_line

        append_jsonl(self.run_dir.evals, record)
        self.tracker.log(record["step"], record)
        log.info(format_eval_line(record))

    def close(self) -> None:
        self.tracker.close()
        if self.progress is not None:
            self.progress.stop()


def memory_gib(device) -> float:
    """Peak allocated device memory (CUDA) or this process's resident set (CPU), in GiB."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def load_summary(counts_per_layer: list) -> tuple[Optional[float], Optional[float]]:
    """(max, mean) over MoE layers of max-count / mean-count. None for a dense model."""
    if not counts_per_layer:
        return None, None
    ratios = [float(load_imbalance(c)) for c in counts_per_layer]
    return max(ratios), sum(ratios) / len(ratios)
