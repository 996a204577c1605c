"""report.html of `moe-launch report`: one self-contained page (PNGs embedded, no scripts) per run or overlay.

A jinja2 template with autoescaping: the run names, overrides and journal texts come from users and nodes, and
hand-escaping every f-string interpolation is where HTML reports usually break.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from moe_launch.orchestrator.report import RunSeries

_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<style>
body { font-family: sans-serif; margin: 2em; max-width: 1100px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } td.why { max-width: 30em; overflow-wrap: anywhere; }
.failure { color: #c0392b; } .swap { color: #d35400; } .restart { color: #8e44ad; } .checkpoint { color: #1e8449; }
figure { margin: 1em 0; } img { max-width: 100%; }
</style></head>
<body>
<h1>{{ title }}</h1>
<h2>Runs</h2>
<table id="runs"><thead><tr><th>run</th><th>legend</th><th>overrides</th><th>status</th><th>steps</th>
<th>final loss</th><th>restarts</th><th>swaps</th><th>tokens/s</th><th>MFU</th><th>wall</th></tr></thead><tbody>
{% for r in runs %}<tr><td>{{ r.name }}</td><td>{{ r.label }}</td><td class="why">{{ r.overrides }}</td>
<td>{{ r.status }}</td><td class="num">{{ r.steps }}</td>
<td class="num">{{ r.final_loss }}</td><td class="num">{{ r.restarts }}</td><td class="num">{{ r.swaps }}</td>
<td class="num">{{ r.tokens_per_s }}</td><td class="num">{{ r.mfu }}</td><td class="num">{{ r.wall }}</td></tr>
{% endfor %}</tbody></table>
{% if goodput %}<h2>Goodput (seconds of wall time)</h2>
<table id="goodput"><thead><tr><th>run</th>{% for k in goodput_keys %}<th>{{ k }}</th>{% endfor %}</tr></thead><tbody>
{% for name, g in goodput %}<tr><td>{{ name }}</td>{% for k in goodput_keys %}<td class="num">{{ g.get(k, "") }}</td>
{% endfor %}</tr>{% endfor %}</tbody></table>{% endif %}
<h2>Plots</h2>
{% for fig in figures %}<figure id="fig-{{ fig.name }}">
<img alt="{{ fig.name }}" src="data:image/png;base64,{{ fig.data }}"></figure>
{% endfor %}
<h2>Events</h2>
{% if events %}<table id="events"><thead><tr><th>time</th><th>run</th><th>step</th><th>event</th></tr></thead><tbody>
{% for e in events %}<tr class="{{ e.kind }}"><td>{{ e.time }}</td><td>{{ e.run }}</td><td class="num">{{ e.step }}</td>
<td>{{ e.what }}</td></tr>
{% endfor %}</tbody></table>{% else %}<p id="events">no failures, swaps, restarts or checkpoints recorded</p>{% endif %}
<p>written {{ written }} by moe-launch report</p>
</body></html>
"""
_ENV = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and value == value else "-"


def _last(s: RunSeries, key: str) -> float:
    y = s.cols[key]
    ok = y[y == y]
    return float(ok[-1]) if ok.size else float("nan")


def _mfu_cell(spec: float, gemm: float) -> str:
    """The data-sheet MFU, else the one against the measured GEMM rate (CPU, an unknown GPU), saying which."""
    if np.isfinite(spec):
        return f"{100 * spec:.1f}%"
    return f"{100 * gemm:.1f}% of GEMM" if np.isfinite(gemm) else "-"


def run_row(s: RunSeries) -> dict[str, str]:
    """Pure: the runs-table cells of one run (summary.json where the run finished, else the metrics so far)."""
    sm = s.summary
    return {"name": s.name, "label": s.label, "status": sm.get("status", "running or interrupted"),
            "steps": _fmt(sm.get("steps_done", s.steps[-1] if len(s.steps) else None), ".0f"),
            "final_loss": _fmt(_last(s, "total_loss"), ".4f"),
            "restarts": _fmt(sm.get("restarts", sum(e.kind == "restart" for e in s.events)), "d"),
            "swaps": _fmt(len(sm.get("swapped_nodes", [])) if sm else sum(e.kind == "swap" for e in s.events), "d"),
            "tokens_per_s": _fmt(float(np.nanmedian(s.cols["tokens_per_s"]))
                                 if np.isfinite(s.cols["tokens_per_s"]).any() else None, ",.0f"),
            "mfu": _mfu_cell(_last(s, "mfu"), _last(s, "mfu_gemm")), "overrides": " ".join(s.overrides) or "-",
            "wall": _fmt(sm.get("wall_s"), ".0f") + (" s" if "wall_s" in sm else "")}


def goodput_cells(g: dict[str, float]) -> dict[str, str]:
    """Pure: goodput as a percentage first, then the seconds of each kind of time (goodput.py's keys)."""
    cells = {"goodput": _fmt(100 * g.get("goodput", float("nan")), ".1f") + "%", "wall": _fmt(g.get("wall_s"), ",.1f")}
    cells.update({k.removesuffix("_s"): _fmt(v, ",.1f") for k, v in g.items() if k.endswith("_s") and k != "wall_s"})
    return cells


def render(series: list[RunSeries], figures: list[Path], written: float) -> str:
    events = [{"time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time)), "run": s.label,
               "step": f"{e.step:.0f}", "kind": e.kind, "what": e.what} for s in series for e in s.events]
    goodput = [(s.label, goodput_cells(s.goodput)) for s in series if s.goodput.get("wall_s")]
    keys = list(dict.fromkeys(k for _, g in goodput for k in g))
    title = "moe-launch report: " + " vs ".join(s.name for s in series)
    return _ENV.from_string(_TEMPLATE).render(
        title=title, runs=[run_row(s) for s in series], goodput=goodput, goodput_keys=keys,
        figures=[{"name": p.stem, "data": base64.b64encode(p.read_bytes()).decode()} for p in figures],
        events=events, written=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written)))


def write_html(series: list[RunSeries], figures: list[Path], path: Path) -> Path:
    path.write_text(render(series, figures, time.time()))
    return path
