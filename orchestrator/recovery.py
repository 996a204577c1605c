"""Where a recovery's seconds went: the `breakdown` of the supervisor's resume record.

The recovery runs from the failure to the first heartbeat of the relaunched attempt (its first completed step). The
failure's moment is its last sign of progress, the failed attempt's last heartbeat: a killed or hung process cannot
say when it stopped, and the work of the step it was in is lost with it. Consecutive phases:

  detect         failure -> the supervisor's decision (process exit seen, fault record read, or hang timeout)
  relaunch       decision -> the new trainer process exists (old step ended, srun / local spawn)
  process_start  -> restore begins (interpreter, imports, CUDA context, rendezvous, model build, data loader)
  restore        -> checkpoint loaded, optimizer built
  compile        torch.compile's time inside the first step
  first_step     the rest of the first step, until its heartbeat

The supervisor knows the first two boundaries and the end; the trainer reports the others (trainer/start_phases.py).
The phases add up to `seconds_since_failure` exactly: times of two processes may disagree by clock skew or arrive out
of order, so each boundary is clamped into [previous boundary, end] rather than producing negative phases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from moe_launch.trainer.start_phases import read_start_record

PHASES = ("detect", "relaunch", "process_start", "restore", "compile", "first_step")


def breakdown(failed_at: float, detected_at: float, resumed_at: float,
              start: Optional[dict[str, Any]]) -> dict[str, float]:
    """Seconds per phase (PHASES order). Without the trainer's start record (`start` None) everything after the
    decision is one `relaunch` phase. Pure."""
    bounds = [failed_at]

    def at(t: Optional[float]) -> float:
        t = bounds[-1] if t is None else min(max(t, bounds[-1]), resumed_at)
        bounds.append(t)
        return t

    at(detected_at)
    if start is None:
        at(resumed_at)
        phases = dict(zip(PHASES[:2], _diffs(bounds)))
        return {k: round(v, 3) for k, v in phases.items()}
    at(start.get("process_start"))
    at(start.get("restore_start"))
    restored = at(start.get("restore_end"))
    compile_s = min(max(float(start.get("compile_s", 0.0)), 0.0), resumed_at - restored)
    at(restored + compile_s)
    at(resumed_at)
    return {k: round(v, 3) for k, v in zip(PHASES, _diffs(bounds))}


def _diffs(bounds: list[float]) -> list[float]:
    return [b - a for a, b in zip(bounds, bounds[1:])]


def resume_details(heartbeat_dir: Path, attempt: int, failed_at: Optional[float], detected_at: float,
                   resumed_at: float) -> dict[str, Any]:
    """The supervisor's resume record details: seconds_since_failure and its breakdown, with the trainer's start
    record of `attempt` if it wrote one. A failure before the failed attempt's first heartbeat (no sign of progress)
    counts from its detection."""
    failed = detected_at if failed_at is None else min(failed_at, detected_at)
    return {"seconds_since_failure": round(resumed_at - failed, 3),
            "breakdown": breakdown(failed, detected_at, resumed_at, read_start_record(heartbeat_dir, attempt))}
