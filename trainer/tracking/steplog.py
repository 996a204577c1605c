"""The plain step log line, written through Python's `logging` with a rank/node prefix.

    2026-12-01 05:40:12 [node3 r0] step 20/60 | loss 5.4321 (lm 5.4102 aux 0.0201 z 0.0018) | lr 3.00e-03 | ...

Batch logs (srun, `make run | tee`) then hold one greppable line per `train.log_interval` steps; a terminal also gets
rich's progress bar (metrics.py), which prints above these lines. `format_step_line` is pure (unit-tested).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

LOGGER = "moe_launch"
_HANDLER_NAME = "moe-launch-rank-prefix"


class _StdoutNow(logging.StreamHandler):
    """Writes to whatever sys.stdout is at emit time: rich's progress bar swaps it for a proxy that prints above
    the bar, and a handler holding the original stream would tear the bar."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def install_rank_logging(rank: int, node: str, level: int = logging.INFO) -> logging.Logger:
    """Configure the `moe_launch` logger of this process: one stdout handler whose lines start with the node and
    rank. Idempotent (a second Trainer in the same process replaces the prefix)."""
    logger = logging.getLogger(LOGGER)
    for h in list(logger.handlers):
        if h.get_name() == _HANDLER_NAME:
            logger.removeHandler(h)
    handler = _StdoutNow()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{node} r{rank}] %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # a host application's root handlers would print every line twice
    return logger


def _num(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def format_step_line(record: dict[str, Any], total_steps: int) -> str:
    """One metrics.jsonl record as a log line; fields the record lacks (dense model, CPU, no preflight) are left out."""
    g = {k: _num(record.get(k)) for k in ("loss", "lm_loss", "aux_loss", "z_loss", "lr", "grad_norm", "tokens_per_s",
                                          "mfu", "mfu_gemm", "expert_load_max", "expert_load_mean", "mem_gib",
                                          "step_time_s")}
    parts = [f"step {record['step']}/{total_steps}"]
    if g["loss"] is not None:
        parts.append(f"loss {g['loss']:.4f} (lm {g['lm_loss']:.4f} aux {g['aux_loss']:.4f} z {g['z_loss']:.4f})"
                     if None not in (g["lm_loss"], g["aux_loss"], g["z_loss"]) else f"loss {g['loss']:.4f}")
    if g["lr"] is not None:
        parts.append(f"lr {g['lr']:.2e}")
    if g["grad_norm"] is not None:
        parts.append(f"grad norm {g['grad_norm']:.3f}")
    if g["tokens_per_s"] is not None:
        parts.append(f"{g['tokens_per_s']:,.0f} tok/s")
    if g["mfu"] is not None or g["mfu_gemm"] is not None:
        mfu = [f"{g['mfu']:.1%}" if g["mfu"] is not None else None,
               f"{g['mfu_gemm']:.1%} of measured GEMM" if g["mfu_gemm"] is not None else None]
        parts.append("mfu " + " / ".join(m for m in mfu if m))
    if g["expert_load_max"] is not None:
        parts.append(f"expert load max {g['expert_load_max']:.2f} mean {g['expert_load_mean']:.2f}")
    if g["mem_gib"] is not None:
        parts.append(f"mem {g['mem_gib']:.1f} GiB")
    if g["step_time_s"] is not None:
        parts.append(f"{g['step_time_s']:.3f} s/step")
    return " | ".join(parts)
