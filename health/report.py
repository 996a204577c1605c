"""Health reports from a cluster's history: a rich table per node for the terminal, and report.html (report_html.py).

Summaries are pure functions of the history records (per node: last status per check, failures, all-to-all busbw,
GEMM TFLOP/s over time, the DCGM test x node matrix, the failure list); rendering is at the edge.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rich.table import Table

from moe_launch.health.result import CHECK_ALLTOALL, CHECK_COMPUTE, CHECK_DCGM
from moe_launch.health.store import NODE_CHECKS

_SPARK = "▁▂▃▄▅▆▇█"
_STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "unavailable": "dim"}


@dataclass
class NodeSummary:
    node: str
    last: dict[str, str] = field(default_factory=dict)  # check -> last status
    last_time: float = 0.0
    failures: int = 0  # node-check failures in the window
    a2a_busbw: list[float] = field(default_factory=list)  # oldest first
    quarantined: bool = False


def summarize(history: list[dict[str, Any]], quarantined: dict[str, Any], since: Optional[float]) -> list[NodeSummary]:
    """Pure: one summary per node seen in the history (group records count for each of their nodes)."""
    nodes: dict[str, NodeSummary] = {}
    for rec in sorted(history, key=lambda r: r.get("time", 0)):
        s = nodes.setdefault(rec["node"], NodeSummary(rec["node"]))
        s.last[rec["check"]] = rec["status"]
        s.last_time = max(s.last_time, rec.get("time", 0))
        in_window = since is None or rec.get("time", 0) >= since
        if in_window and rec["status"] == "fail" and rec["check"] in NODE_CHECKS:
            s.failures += 1
        if rec["check"] == CHECK_ALLTOALL and rec.get("value") is not None and in_window:
            s.a2a_busbw.append(float(rec["value"]))
    for name in quarantined:
        nodes.setdefault(name, NodeSummary(name)).quarantined = True
    for s in nodes.values():
        s.quarantined = s.node in quarantined
    return [nodes[k] for k in sorted(nodes)]


def sparkline(values: list[float], width: int = 12) -> str:
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(_SPARK[int((v - lo) / span * (len(_SPARK) - 1))] for v in values)


def a2a_series(history: list[dict[str, Any]], since: Optional[float]) -> dict[int, list[tuple[float, float]]]:
    """Pure: node count -> [(time, busbw)] (a group result is stored once per node; keep one point per run)."""
    seen: set[tuple] = set()
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for rec in history:
        if rec["check"] != CHECK_ALLTOALL or rec.get("value") is None or "nodes" not in rec:
            continue
        if since is not None and rec.get("time", 0) < since:
            continue
        key = (rec.get("run"), rec["nodes"], round(rec["value"], 12), round(rec.get("time", 0), 1))
        if key in seen:
            continue
        seen.add(key)
        out[int(rec["nodes"])].append((rec["time"], float(rec["value"])))
    return {k: sorted(v) for k, v in sorted(out.items())}


def failures_per_node(history: list[dict[str, Any]], since: Optional[float]) -> dict[str, int]:
    counts: dict[str, int] = {rec["node"]: 0 for rec in history if rec["check"] in NODE_CHECKS}
    for rec in history:
        if rec["status"] == "fail" and rec["check"] in NODE_CHECKS and (since is None or rec.get("time", 0) >= since):
            counts[rec["node"]] = counts.get(rec["node"], 0) + 1
    return dict(sorted(counts.items()))


def rich_table(summaries: list[NodeSummary], checks: list[str], title: str) -> Table:
    table = Table(title=title)
    table.add_column("node", style="bold")
    for check in checks:
        table.add_column(check)
    table.add_column("failures")
    table.add_column("a2a busbw GB/s (trend)")
    table.add_column("last seen")
    table.add_column("quarantine")
    for s in summaries:
        cells = [f"[{_STATUS_STYLE.get(s.last.get(c, ''), '')}]{s.last.get(c, '-')}[/]" if c in s.last else "-"
                 for c in checks]
        trend = f"{s.a2a_busbw[-1]:.4g} {sparkline(s.a2a_busbw)}" if s.a2a_busbw else "-"
        seen = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.last_time)) if s.last_time else "-"
        table.add_row(s.node, *cells, str(s.failures), trend, seen, "[bold red]yes[/]" if s.quarantined else "")
    return table


def compute_series(history: list[dict[str, Any]], since: Optional[float]) -> dict[str, list[tuple[float, float]]]:
    """Pure: node -> [(time, GEMM TFLOP/s)] of its compute checks (mean over the node's devices per check time)."""
    per: dict[tuple[str, float], list[float]] = defaultdict(list)
    for rec in history:
        if rec["check"] != CHECK_COMPUTE or not isinstance(rec.get("value"), (int, float)):
            continue
        if since is not None and rec.get("time", 0) < since:
            continue
        per[(rec["node"], round(rec.get("time", 0), 0))].append(float(rec["value"]))
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (node, t), values in sorted(per.items()):
        out[node].append((t, sum(values) / len(values)))
    return dict(sorted(out.items()))


_DCGM_TEST = re.compile(r"^dcgm (\S+) gpu (\S+): (\w+)")
ALL_TESTS = "all tests"


def dcgm_matrix(history: list[dict[str, Any]], since: Optional[float]) -> tuple[list[str], list[str], dict]:
    """Pure: (tests, nodes, {(test, node): status}) from each node's latest DCGM result. A failing or warning result
    names its tests in its reasons ("dcgm Category/Test gpu 0,1: fail (...)"); every other test of that run passed.
    Without any named test the matrix has one row, ALL_TESTS."""
    latest: dict[str, dict[str, Any]] = {}
    tests: set[str] = set()
    for rec in sorted(history, key=lambda r: r.get("time", 0)):
        if rec["check"] != CHECK_DCGM or (since is not None and rec.get("time", 0) < since):
            continue
        latest[rec["node"]] = rec
        tests |= {m.group(1) for why in rec.get("reasons") or [] if (m := _DCGM_TEST.match(why))}
    rows = sorted(tests) or [ALL_TESTS]
    cells = {}
    for node, rec in latest.items():
        named = {m.group(1): m.group(3) for why in rec.get("reasons") or [] if (m := _DCGM_TEST.match(why))}
        for test in rows:
            if rec["status"] in ("pass", "unavailable") or (test == ALL_TESTS and not named):
                cells[(test, node)] = rec["status"]
            else:
                cells[(test, node)] = named.get(test, "pass")
    return rows, sorted(latest), cells


def failure_rows(history: list[dict[str, Any]], quarantined: dict[str, Any], since: Optional[float]) -> list[dict]:
    """Pure: every failed node check in the window, newest first, with its reasons and the node's quarantine state."""
    rows = [{"time": rec.get("time", 0), "node": rec["node"], "check": rec["check"], "run": rec.get("run", ""),
             "reasons": "; ".join(rec.get("reasons") or []) or "failed", "quarantined": rec["node"] in quarantined}
            for rec in history if rec["status"] == "fail" and rec["check"] in NODE_CHECKS
            and (since is None or rec.get("time", 0) >= since)]
    return sorted(rows, key=lambda r: -r["time"])


@dataclass
class HistorySources:
    """Where `moe-health report` read its history and writes its page."""

    dirs: list[Path]  # cluster store directories holding history.jsonl
    out_dir: Path  # report.html goes here: the store, or the run's health/ directory
    looked: list[str]  # every place searched, for the message when nothing is found
    not_shown: list[Path] = field(default_factory=list)  # runs' own histories left out (the cluster store won)


def history_sources(store_cdir: Path, run: Optional[Path], runs_root: Path) -> HistorySources:
    """A named run's history (cluster=local runs keep theirs in runs/<name>/health/store/<cluster>/), else the
    configured cluster store, else every run under `runs_root` that kept its own (the newest run gets the page)."""
    def stores_of(run_dir: Path) -> list[Path]:
        return sorted(p.parent for p in (run_dir / "health" / "store").glob("*/history.jsonl"))

    if run is not None:
        found = stores_of(run) or ([store_cdir] if (store_cdir / "history.jsonl").exists() else [])
        return HistorySources(found, run / "health", [str(run / "health" / "store" / "*"), str(store_cdir)])
    looked = [str(store_cdir), str(runs_root / "*" / "health" / "store" / "*")]
    found = sorted((p.parent for p in runs_root.glob("*/health/store/*/history.jsonl")),
                   key=lambda d: (d / "history.jsonl").stat().st_mtime)
    if (store_cdir / "history.jsonl").exists():
        return HistorySources([store_cdir], store_cdir, looked, not_shown=found)
    out = found[-1].parents[1] if found else store_cdir
    return HistorySources(found, out, looked)


def build(history: list[dict[str, Any]], quarantined: dict[str, Any], since: Optional[float], cluster: str,
          html_path: Optional[Path], source: str = "") -> Table:
    summaries = summarize(history, quarantined, since)
    checks = sorted({rec["check"] for rec in history})
    title = f"moe-health report: cluster {cluster}"
    if html_path is not None:
        from moe_launch.health.report_html import page

        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(page(history, quarantined, since, summaries, checks, title, source))
    return rich_table(summaries, checks, title)
