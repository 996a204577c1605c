"""Health reports from a cluster's history: a rich table per node for the terminal, and report.html with plots.

The HTML is one self-contained file (plots are matplotlib PNGs embedded as base64, no scripts), so it opens anywhere,
including a headless browser in CI. Summaries are pure functions of the history records; rendering is at the edge.
"""

from __future__ import annotations

import base64
import html
import io
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from rich.table import Table

from moe_launch.health.result import CHECK_ALLTOALL
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


def _png_b64(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def plots(history: list[dict[str, Any]], since: Optional[float]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.dates
    import matplotlib.pyplot as plt

    out = {}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for n, points in a2a_series(history, since).items():
        ax.plot([datetime.fromtimestamp(t) for t, _ in points], [v for _, v in points], marker="o",
                label=f"{n} nodes")
    ax.set_ylabel("all-to-all busbw (GB/s)")
    ax.set_title("All-to-all bandwidth per node count")
    ax.tick_params(axis="x", rotation=30, labelsize=7)
    ax.xaxis.set_major_formatter(matplotlib.dates.DateFormatter("%m-%d %H:%M"))
    if ax.lines:
        ax.legend()
    out["bandwidth"] = _png_b64(fig)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.0))
    fails = failures_per_node(history, since)
    ax.bar(list(fails), list(fails.values()), color="#c0392b")
    ax.set_ylabel("failed node checks")
    ax.set_title("Failures per node")
    out["failures"] = _png_b64(fig)
    plt.close(fig)
    return out


def html_report(summaries: list[NodeSummary], checks: list[str], images: dict[str, str], title: str) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in ["node", *checks, "failures", "a2a busbw GB/s", "trend", "quarantine"])
    rows = []
    for s in summaries:
        cells = "".join(f'<td class="{esc(s.last.get(c, "none"))}">{esc(s.last.get(c, "-"))}</td>' for c in checks)
        last = f"{s.a2a_busbw[-1]:.4g}" if s.a2a_busbw else "-"
        rows.append(f"<tr><td>{esc(s.node)}</td>{cells}<td>{s.failures}</td><td>{last}</td>"
                    f"<td>{esc(sparkline(s.a2a_busbw))}</td><td>{'yes' if s.quarantined else ''}</td></tr>")
    imgs = "".join(f'<figure><img alt="{esc(k)}" src="data:image/png;base64,{v}"></figure>' for k, v in images.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }} table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; }} .pass {{ color: #1e8449; }}
.fail {{ color: #c0392b; font-weight: bold; }} .warn {{ color: #b9770e; }} .unavailable {{ color: #888; }}
figure {{ display: inline-block; margin: 1em; }}
</style></head>
<body><h1>{esc(title)}</h1>
<table id="nodes"><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>
{imgs}
</body></html>
"""


def build(history: list[dict[str, Any]], quarantined: dict[str, Any], since: Optional[float], cluster: str,
          html_path: Optional[Path]) -> Table:
    summaries = summarize(history, quarantined, since)
    checks = sorted({rec["check"] for rec in history})
    title = f"moe-health report: cluster {cluster}"
    if html_path is not None:
        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(html_report(summaries, checks, plots(history, since), title))
    return rich_table(summaries, checks, title)
