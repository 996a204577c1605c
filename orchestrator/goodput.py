"""Goodput: the share of a run's wall time that produced training progress that was kept, and where the rest went.

Pure functions over the run directory's journal.jsonl and metrics.jsonl records (no torch, no files):

  productive   optimizer steps whose result is part of the final model (their step_time_s), less the
               checkpoint stalls inside them; the first step after a relaunch counts as recovery
  checkpoint   training blocked by checkpoint writes (`stall_s` of each checkpoint record, `seconds` of a
               synchronous one)
  recovery     failure -> first step of the relaunched attempt (the supervisor's resume records:
               seconds_since_failure, itself broken down in the record)
  lost         steps computed after the checkpoint a relaunch resumed from: done again later, so their first run
               was wasted (a step logged twice: the earlier one)
  preflight    allocation -> the trainer's first launch in it (health checks)
  startup      a first launch -> its first step (process start, load, compile); relaunches count as recovery
  other        the rest: queueing between allocations, the final checkpoint, shutdown, unlogged steps
goodput = productive / wall. `timeline` gives the same as time segments, for plotting.

metrics.jsonl holds every `train.log_interval`-th step: the logged steps' times are scaled by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

KINDS = ("productive", "checkpoint", "recovery", "lost", "preflight", "startup", "other")


@dataclass(frozen=True)
class Segment:
    kind: str  # one of KINDS except productive / other (those fill the gaps)
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


def _rows(metrics: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((m for m in metrics if "step" in m and "time" in m), key=lambda m: m["time"])


def lost_rows(metrics: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logged steps that were computed again later (a relaunch resumed from an earlier checkpoint)."""
    rows = _rows(metrics)
    last_time = {}
    for m in rows:
        last_time[m["step"]] = m["time"]
    return [m for m in rows if m["time"] < last_time[m["step"]]]


def timeline(journal: Iterable[dict[str, Any]], metrics: Iterable[dict[str, Any]]) -> list[Segment]:
    """Time segments that were not productive training, in time order."""
    records = sorted(journal, key=lambda r: r["time"])
    rows = _rows(metrics)
    out: list[Segment] = []
    allocation_t = None
    for r in records:
        d, kind = r.get("details", {}), r["kind"]
        if kind == "allocation":
            allocation_t = r["time"]
        elif kind == "launch":
            if allocation_t is not None:  # the first launch of this allocation
                out.append(Segment("preflight", allocation_t, r["time"]))
                allocation_t = None
                first = next((m for m in rows if m["time"] > r["time"]), None)
                if first is not None and (d.get("action") or {}).get("kind", "launch") == "launch":
                    out.append(Segment("startup", r["time"], first["time"] - float(first.get("step_time_s", 0.0))))
        elif kind == "resume" and "seconds_since_failure" in d:
            out.append(Segment("recovery", r["time"] - float(d["seconds_since_failure"]), r["time"]))
        elif kind == "checkpoint":
            stall = float(d.get("stall_s", d.get("seconds", 0.0)))
            # an asynchronous checkpoint is journaled when durable; it stalled training at its request
            requested = r["time"] - float(d.get("durable_s", stall))
            out.append(Segment("checkpoint", requested, requested + stall))
    for m in lost_rows(rows):
        out.append(Segment("lost", m["time"] - float(m.get("step_time_s", 0.0)), m["time"]))
    return sorted(out, key=lambda s: s.start)


def goodput(journal: Iterable[dict[str, Any]], metrics: Iterable[dict[str, Any]],
            log_interval: Optional[int] = None) -> dict[str, float]:
    """Seconds per kind (KINDS, suffixed _s), wall_s, and goodput = productive / wall. `log_interval` None: the
    smallest step distance between logged rows."""
    records = list(journal)
    rows = _rows(metrics)
    if log_interval is None:
        steps = sorted({m["step"] for m in rows})
        log_interval = min((b - a for a, b in zip(steps, steps[1:])), default=1)
    times = [r["time"] for r in records] + [m["time"] for m in rows]
    if not times:
        return {"wall_s": 0.0, "goodput": 0.0}
    wall = max(times) - min(times)
    segments = timeline(records, rows)
    spent = {k: 0.0 for k in KINDS}
    for s in segments:
        spent[s.kind] += s.seconds
    lost = {id(m) for m in lost_rows(rows)}
    not_kept = lost | {id(m) for m in (_first_row_after(rows, s.end) for s in segments if s.kind == "recovery") if m}
    kept = [m for m in rows if id(m) not in not_kept]
    productive = sum(float(m.get("step_time_s", 0.0)) for m in kept)
    for s in segments:  # a checkpoint written after step k blocks the interval that step k+1's step_time_s measures
        m = _first_row_after(rows, s.end) if s.kind == "checkpoint" else None
        if m is not None and m["time"] - float(m.get("step_time_s", 0.0)) <= s.start:
            if id(m) in lost:
                spent["lost"] -= s.seconds
            elif id(m) not in not_kept:
                productive -= s.seconds
    spent["lost"] = max(0.0, spent["lost"]) * log_interval
    spent["productive"] = max(0.0, productive * log_interval)
    spent["other"] = max(0.0, wall - sum(v for k, v in spent.items() if k != "other"))
    out = {f"{k}_s": round(v, 3) for k, v in spent.items()}
    out["wall_s"] = round(wall, 3)
    out["goodput"] = round(spent["productive"] / wall, 4) if wall > 0 else 0.0
    return out


def _first_row_after(rows: list[dict[str, Any]], t: float) -> Any:
    return next((m for m in rows if m["time"] >= t), None)
