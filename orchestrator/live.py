"""The login side's view of a run, built only from the run directory (journal.jsonl, metrics.jsonl, summary.json),
so `moe-launch attach` after a lost login session shows exactly what the original session showed.

`snapshot()` is pure over the files' contents; `LiveView` renders it with rich (a live panel on a terminal; otherwise
one plain line per journal event and per logged step, in time order, so `moe-launch ... | tee` and CI logs show the
loss as it goes).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from moe_launch.orchestrator.state import SupervisorState, replay
from moe_launch.rundir import RunDir, read_jsonl


@dataclass
class Snapshot:
    state: Optional[SupervisorState]
    journal: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    summary: Optional[dict[str, Any]]
    total_steps: int
    eta_s: Optional[float] = None
    node_steps: dict[str, int] = field(default_factory=dict)  # node -> last heartbeat step


def eta_seconds(metrics: list[dict[str, Any]], total_steps: int, window: int = 20) -> Optional[float]:
    """Remaining steps times the recent seconds per step (metrics of the current attempt only). Pure."""
    recent = [m for m in metrics[-window:] if "time" in m and "step" in m]
    for i in range(len(recent) - 1, 0, -1):  # keep the tail after the last resume (steps went backwards)
        if recent[i]["step"] <= recent[i - 1]["step"]:
            recent = recent[i:]
            break
    if len(recent) < 2 or recent[-1]["step"] == recent[0]["step"]:
        return None
    per_step = (recent[-1]["time"] - recent[0]["time"]) / (recent[-1]["step"] - recent[0]["step"])
    return max(0.0, (total_steps - recent[-1]["step"]) * per_step)


def snapshot(rd: RunDir, want: int, max_restarts: int, total_steps: int) -> Snapshot:
    journal = read_jsonl(rd.journal)
    metrics = [m for m in read_jsonl(rd.metrics) if "step" in m]
    summary = None
    if rd.summary.exists():
        try:
            summary = json.loads(rd.summary.read_text())
        except json.JSONDecodeError:
            summary = None
    node_steps: dict[str, int] = {}
    for path in rd.heartbeat.glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
            node_steps[beat["host"]] = max(node_steps.get(beat["host"], -1), int(beat["step"]))
        except (OSError, ValueError, KeyError):
            continue
    return Snapshot(replay(journal, want, max_restarts), journal, metrics, summary, total_steps,
                    eta_seconds(metrics, total_steps), node_steps)


def describe(rec: dict[str, Any]) -> str:
    """One journal record as one human line."""
    d = rec.get("details") or {}
    t = time.strftime("%H:%M:%S", time.localtime(rec.get("time", 0)))
    nodes = ",".join(rec.get("nodes") or [])
    text = d.get("reason") or d.get("message") or d.get("detail") or ""
    if not text:
        keep = {k: v for k, v in d.items() if k not in ("action", "event") and v not in (None, "", [], {})}
        text = " ".join(f"{k}={v}" for k, v in list(keep.items())[:6])
    if d.get("event"):
        text = f"{d['event']}: {text}"
    return f"{t} {rec.get('kind', '?'):<10} {nodes:<20} {text}"


def plain_lines(journal: list[dict[str, Any]], metrics: list[dict[str, Any]], total_steps: int) -> list[str]:
    """Pure: new journal records and new metrics records as lines, merged by time."""
    from moe_launch.trainer.tracking.steplog import format_step_line

    stamped = [(r.get("time", 0), describe(r)) for r in journal]
    stamped += [(m.get("time", 0), f"{time.strftime('%H:%M:%S', time.localtime(m.get('time', 0)))} "
                                   f"{'step':<10} {format_step_line(m, total_steps)}") for m in metrics if "step" in m]
    return [line for _, line in sorted(stamped, key=lambda tl: tl[0])]


def render(s: Snapshot) -> Group:
    last = s.metrics[-1] if s.metrics else {}
    st = s.state
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[b]step[/b] {last.get('step', 0)}/{s.total_steps}",
        f"[b]loss[/b] {last['loss']:.4f}" if isinstance(last.get("loss"), (int, float)) else "[b]loss[/b] -",
        f"[b]tok/s[/b] {last.get('tokens_per_s', 0):,.0f}",
        f"[b]restarts[/b] {st.restarts if st else 0}",
        f"[b]ETA[/b] {_fmt_s(s.eta_s)}",
        f"[b]status[/b] {(s.summary or {}).get('status') or (st.phase if st else 'submitted')}",
    )
    nodes = Table(title="nodes", show_edge=False)
    for col in ("node", "role", "step", "note"):
        nodes.add_column(col)
    if st:
        for n in st.active:
            nodes.add_row(n, "[green]active[/green]", str(s.node_steps.get(n, "-")), "")
        for n in st.buffers:
            nodes.add_row(n, "[cyan]buffer[/cyan]", "", "")
        for n in st.suspects:
            nodes.add_row(n, "[yellow]suspect[/yellow]", "", "re-check pending")
        for n, why in st.excluded.items():
            nodes.add_row(n, "[red]excluded[/red]", "", why[:80])
    events = Table(title="journal", show_edge=False, show_header=False)
    events.add_column("event")
    for rec in s.journal[-8:]:
        events.add_row(describe(rec))
    return Group(head, nodes, events)


def _fmt_s(sec: Optional[float]) -> str:
    if sec is None:
        return "-"
    m, s = divmod(int(sec), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


class LiveView:
    """Call `update()` every poll; `close()` at the end. Plain mode prints each new journal record once."""

    def __init__(self, rd: RunDir, want: int, max_restarts: int, total_steps: int,
                 console: Optional[Console] = None):
        self.rd, self.want, self.max_restarts, self.total_steps = rd, want, max_restarts, total_steps
        self.console = console or Console()
        self.printed = 0
        self.printed_steps = 0
        self.live: Optional[Live] = None
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=2, transient=False)
            self.live.start()

    def update(self) -> Snapshot:
        s = snapshot(self.rd, self.want, self.max_restarts, self.total_steps)
        if self.live is not None:
            self.live.update(render(s))
        else:
            for line in plain_lines(s.journal[self.printed:], s.metrics[self.printed_steps:], self.total_steps):
                self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            self.printed, self.printed_steps = len(s.journal), len(s.metrics)
        return s

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
