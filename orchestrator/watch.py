"""Turns the run directory's per-rank files into events for the trainer attempt now running.

Reads the trainer's contract (moe_launch.rundir): heartbeat/rank<r>.json (step, time, host, pid) and
faults/<host>-rank<r>-step<s>.json (host, rank, step, what, time). Files older than the attempt's launch belong to an
earlier attempt and are ignored. A hang is declared when no heartbeat of this attempt was written for
supervisor.hang_timeout_s; the suspects are the nodes whose ranks are behind the others (none: nobody to blame).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from moe_launch.orchestrator.events import Event, Fault, Hang, LaunchTimeout
from moe_launch.rundir import RunDir


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # being replaced right now, or torn: read it next poll


def read_heartbeats(rd: RunDir, since: float) -> dict[int, dict[str, Any]]:
    beats = {}
    for path in rd.heartbeat.glob("rank*.json"):
        rec = _read_json(path)
        if rec and rec.get("time", 0) >= since:
            beats[int(path.stem[len("rank"):])] = rec
    return beats


def hang_suspects(beats: dict[int, dict[str, Any]]) -> tuple[str, ...]:
    """Hosts of the ranks that stopped at a lower step than the rest; () when all stopped at the same step."""
    if not beats:
        return ()
    top = max(b["step"] for b in beats.values())
    return tuple(sorted({b["host"] for b in beats.values() if b["step"] < top}))


class Watcher:
    def __init__(self, rd: RunDir, hang_timeout_s: float, launch_timeout_s: float):
        self.rd, self.hang_timeout_s, self.launch_timeout_s = rd, hang_timeout_s, launch_timeout_s
        self.seen_faults: set[str] = set()
        self.start_attempt(-1, 0.0)

    def start_attempt(self, attempt: int, now: float) -> None:
        self.attempt, self.t_launch = attempt, now
        self.last_beat: Optional[float] = None
        self.step = -1
        self.first_beat: Optional[dict[str, Any]] = None  # set once: the attempt's first heartbeat (resume point)
        self.fired = False  # one hang / launch-timeout event per attempt

    def faults(self) -> list[Event]:
        out: list[Event] = []
        for path in sorted(self.rd.faults.glob("*.json")):
            if path.name in self.seen_faults:
                continue
            rec = _read_json(path)
            if rec is None:
                continue
            self.seen_faults.add(path.name)
            if rec.get("time", path.stat().st_mtime) >= self.t_launch:
                out.append(Fault(attempt=self.attempt, node=str(rec["host"]), rank=int(rec["rank"]),
                                 step=int(rec["step"]), what=str(rec.get("what", "fault"))))
        return out

    def poll(self, now: float) -> list[Event]:
        events = self.faults()
        if self.attempt < 0:
            return events
        beats = read_heartbeats(self.rd, self.t_launch)
        if beats:
            latest = max(b["time"] for b in beats.values())
            if self.first_beat is None:
                self.first_beat = min(beats.values(), key=lambda b: b["time"])
            self.last_beat = max(self.last_beat or 0.0, latest)
            self.step = max(b["step"] for b in beats.values())
        if self.fired:
            return events
        if self.last_beat is None and now - self.t_launch > self.launch_timeout_s:
            self.fired = True
            events.append(LaunchTimeout(attempt=self.attempt))
        elif self.last_beat is not None and now - self.last_beat > self.hang_timeout_s:
            self.fired = True
            events.append(Hang(attempt=self.attempt, suspects=hang_suspects(beats), step=self.step,
                               idle_s=now - self.last_beat))
        return events
