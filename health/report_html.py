"""report.html of `moe-health report`: one self-contained page (PNGs embedded as base64, no scripts) that opens
anywhere, including a headless browser in CI. A jinja2 template with autoescaping (node names and DCGM messages are
not ours to trust); the figures come from the pure summaries in report.py.

A figure is drawn only when the history holds its data (no empty axes); time axes use matplotlib's concise date
formatter, which never repeats a tick label.
"""

from __future__ import annotations

import base64
import io
import time
from datetime import datetime
from typing import Any, Optional

import jinja2

from moe_launch.health.report import (
    NodeSummary,
    a2a_series,
    compute_series,
    dcgm_matrix,
    failure_rows,
    sparkline,
)

_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<style>
body { font-family: sans-serif; margin: 2em; } table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; white-space: nowrap; }
td.why { white-space: normal; max-width: 60em; overflow-wrap: anywhere; }
.pass { color: #1e8449; } .fail { color: #c0392b; font-weight: bold; } .warn { color: #b9770e; }
.unavailable, .none { color: #888; } figure { margin: 1em 0; } img { max-width: 100%; }
</style></head>
<body><h1>{{ title }}</h1>
<p id="source">history: {{ source }}</p>
<h2>Nodes</h2>
<table id="nodes"><thead><tr><th>node</th>{% for c in checks %}<th>{{ c }}</th>{% endfor %}<th>failures</th>
<th>a2a busbw GB/s</th><th>trend</th><th>quarantine</th></tr></thead><tbody>
{% for s in nodes %}<tr><td>{{ s.node }}</td>{% for c in checks %}
<td class="{{ s.last.get(c, 'none') }}">{{ s.last.get(c, '-') }}</td>
{% endfor %}<td>{{ s.failures }}</td><td>{{ s.busbw }}</td><td>{{ s.trend }}</td><td>{{ s.quarantine }}</td></tr>
{% endfor %}</tbody></table>
{% if dcgm_nodes %}<h2>DCGM diagnostics (latest per node)</h2>
<table id="dcgm"><thead><tr><th>test</th>{% for n in dcgm_nodes %}<th>{{ n }}</th>{% endfor %}</tr></thead><tbody>
{% for t in dcgm_tests %}<tr><td>{{ t }}</td>{% for n in dcgm_nodes %}{% set st = dcgm_cells.get((t, n), "-") %}
<td class="{{ st }}">{{ st }}</td>{% endfor %}</tr>
{% endfor %}</tbody></table>{% endif %}
<h2>Failures</h2>
{% if failures %}<table id="failures"><thead><tr><th>time</th><th>node</th><th>check</th><th>run</th><th>reasons</th>
<th>quarantined</th></tr></thead><tbody>
{% for f in failures %}<tr><td>{{ f.time }}</td><td>{{ f.node }}</td><td>{{ f.check }}</td><td>{{ f.run }}</td>
<td class="why">{{ f.reasons }}</td><td>{{ "yes" if f.quarantined else "no" }}</td></tr>
{% endfor %}</tbody></table>{% else %}<p id="failures">no failed node checks in this window</p>{% endif %}
{% for fig in figures %}<figure id="fig-{{ fig.name }}">
<img alt="{{ fig.name }}" src="data:image/png;base64,{{ fig.data }}"></figure>{% endfor %}
</body></html>
"""
_ENV = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)


def _png_b64(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _time_axis(ax) -> None:
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator(minticks=3, maxticks=7)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))


def series_figure(points_by: dict[Any, list[tuple[float, float]]], label: str, ylabel: str, title: str):
    """A matplotlib Figure: one line per key over wall time."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.6))
    ax = fig.add_subplot()
    for key, points in points_by.items():
        ax.plot([datetime.fromtimestamp(t) for t, _ in points], [v for _, v in points], marker="o",
                label=label.format(key))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    top = max(v for points in points_by.values() for _, v in points)
    ax.set_ylim(0, 1.12 * top if top > 0 else 1.0)  # rates: zero-based, so a flat series is not magnified into noise
    _time_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return fig


def figures(history: list[dict[str, Any]], since: Optional[float]) -> dict[str, str]:
    """name -> base64 PNG, for the figures the history has data for."""
    out = {}
    a2a = a2a_series(history, since)
    if a2a:
        out["bandwidth"] = _png_b64(series_figure(a2a, "{} nodes", "all-to-all busbw (GB/s)",
                                                  "All-to-all bandwidth per node count"))
    gemm = compute_series(history, since)
    if gemm:
        out["gemm"] = _png_b64(series_figure(gemm, "{}", "GEMM TFLOP/s (mean over devices)", "Compute check per node"))
    return out


def page(history: list[dict[str, Any]], quarantined: dict[str, Any], since: Optional[float],
         summaries: list[NodeSummary], checks: list[str], title: str, source: str = "") -> str:
    tests, dnodes, cells = dcgm_matrix(history, since)
    nodes = [{"node": s.node, "last": s.last, "failures": s.failures,
              "busbw": f"{s.a2a_busbw[-1]:.4g}" if s.a2a_busbw else "-", "trend": sparkline(s.a2a_busbw),
              "quarantine": "yes" if s.quarantined else ""} for s in summaries]
    failures = [{**f, "time": time.strftime("%Y-%m-%d %H:%M", time.localtime(f["time"]))}
                for f in failure_rows(history, quarantined, since)]
    return _ENV.from_string(_TEMPLATE).render(
        title=title, source=source or "-", checks=checks, nodes=nodes, dcgm_tests=tests, dcgm_nodes=dnodes,
        dcgm_cells=cells, failures=failures,
        figures=[{"name": k, "data": v} for k, v in figures(history, since).items()])
