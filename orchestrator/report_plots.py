"""The figures of `moe-launch report` (report.py reads the runs): matplotlib's object API, no pyplot state, no display.

A figure is drawn only when some run logged its values (no empty axes); every line plot carries the runs' journal
events on its step axis, one style per event class, named once in the legend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from moe_launch.orchestrator.report import RunSeries

# event class -> (colour, line style, legend name); checkpoints are frequent, so only a short tick at the bottom
EVENT_STYLE = {
    "failure": ("#c0392b", "-", "failure / fault"),
    "swap": ("#e67e22", "--", "node swap"),
    "restart": ("#8e44ad", "-.", "restart"),
    "stop": ("#555555", ":", "stop"),
    "checkpoint": ("#27ae60", "-", "checkpoint"),
}


def _figure(rows: int = 1, height: float = 3.8):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 0.6 + height * rows), dpi=100)
    return fig, fig.subplots(rows, 1, squeeze=False, sharex=True)[:, 0]


def mark_events(ax, series: list[RunSeries]) -> None:
    """Vertical markers at each event's step; a legend entry per event class present."""
    seen = set()
    for s in series:
        for ev in s.events:
            colour, style, name = EVENT_STYLE[ev.kind]
            label = None if ev.kind in seen else name
            seen.add(ev.kind)
            if ev.kind == "checkpoint":
                ax.axvline(ev.step, ymin=0, ymax=0.06, color=colour, lw=1.5, label=label)
            else:
                ax.axvline(ev.step, color=colour, ls=style, lw=1.2, alpha=0.85, label=label)


def _has(series: list[RunSeries], key: str) -> bool:
    return any(np.isfinite(s.cols[key]).any() for s in series)


def _lines(ax, series: list[RunSeries], y_of: Callable[[RunSeries], np.ndarray], suffix: str = "") -> None:
    for s in series:
        y = y_of(s)
        ok = np.isfinite(y)
        if ok.any():
            ax.plot(s.steps[ok], y[ok], marker="." if ok.sum() < 40 else None, label=s.label + suffix)


def unflatten(ax) -> None:
    """A constant series (a constant lr, a steady z-loss) gets a zero-based axis: matplotlib would otherwise zoom
    into +-4% of the value and draw noise-free data as if it wobbled."""
    ys = [y for line in ax.lines for y in np.asarray(line.get_ydata(), dtype=float) if np.isfinite(y)]
    if ys and max(ys) == min(ys) and ax.get_yscale() == "linear":
        v = ys[0]
        ax.set_ylim(min(0.0, 1.25 * v), max(0.0, 1.25 * v) or 1.0)


def _finish(fig, axes, path: Path) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3)
        unflatten(ax)
    if axes[0].get_legend_handles_labels()[0]:  # panels share runs and events: one legend, on the first
        axes[0].legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    return path


def line_figure(series: list[RunSeries], key: str, ylabel: str, title: str, path: Path, log_y: bool = False) -> Path:
    fig, (ax,) = _figure()
    _lines(ax, series, lambda s: s.cols[key] if key != "step_time" else s.step_time)
    mark_events(ax, series)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
    return _finish(fig, [ax], path)


def loss_figure(series: list[RunSeries], path: Path) -> Path:
    panels = [(k, name) for k, name in (("loss", "LM loss"), ("aux_loss", "aux (load-balancing) loss"),
                                        ("z_loss", "router z-loss")) if _has(series, k)]
    fig, axes = _figure(len(panels), height=2.6)
    for ax, (key, name) in zip(axes, panels):
        _lines(ax, series, lambda s, k=key: s.cols[k])
        mark_events(ax, series)
        ax.set_ylabel(name)
    for s in series:  # the held-out evaluations, on the LM loss panel
        if len(s.heldout):
            axes[0].plot(s.heldout[:, 0], s.heldout[:, 1], marker="o", linestyle="--", label=s.label + " held-out")
    axes[0].set_title("Loss")
    return _finish(fig, axes, path)


def mfu_figure(series: list[RunSeries], path: Path) -> Path:
    fig, (ax,) = _figure()
    _lines(ax, series, lambda s: 100 * s.cols["mfu"], " (data-sheet peak)")
    ax.set_prop_cycle(None)
    _lines(ax, series, lambda s: 100 * s.cols["mfu_gemm"], " (measured GEMM)")
    for line in ax.lines:
        if line.get_label().endswith("(measured GEMM)"):
            line.set_linestyle("--")
    mark_events(ax, series)
    ax.set_ylabel("MFU (%)")
    ax.set_title("Model FLOPs utilisation")
    return _finish(fig, [ax], path)


def expert_load_figure(series: list[RunSeries], path: Path, max_layers: int = 16) -> Path:
    """One panel per MoE layer (and run): expert x logged step, colour = load / layer mean (1.0 = balanced)."""
    from matplotlib.colors import TwoSlopeNorm

    panels = [(s, layer) for s in series if s.load_SLE is not None for layer in range(min(s.load_SLE.shape[1],
                                                                                           max_layers))]
    fig, axes = _figure(len(panels), height=2.2)
    vmax = max(float(s.load_SLE.max()) for s, _ in panels)
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(vmax, 1.01))
    for ax, (s, layer) in zip(axes, panels):
        steps = s.load_steps  # logged steps, or bin centres (report.bin_steps): cells span to the midpoints
        mids = (steps[1:] + steps[:-1]) / 2 if len(steps) > 1 else np.zeros(0)
        half = (steps[1] - steps[0]) / 2 if len(steps) > 1 else 0.5
        edges = np.concatenate([[steps[0] - half], mids, [steps[-1] + (steps[-1] - mids[-1] if len(mids) else 0.5)]])
        E = s.load_SLE.shape[2]
        im = ax.pcolormesh(edges, np.arange(E + 1) - 0.5, s.load_SLE[:, layer, :].T, cmap="RdBu_r", norm=norm,
                           shading="flat")
        ax.set_ylabel(f"layer {layer}\nexpert")
        ax.set_title(f"{s.label}: MoE layer {layer}", fontsize=9)
        fig.colorbar(im, ax=ax, label="load / mean", pad=0.01)
    return _finish(fig, axes, path)


def balance_figure(series: list[RunSeries], path: Path) -> Path:
    fig, (ax,) = _figure()
    _lines(ax, series, lambda s: s.cols["load_max"], ", max over layers")
    _lines(ax, series, lambda s: s.cols["load_mean"], ", mean over layers")
    ax.axhline(1.0, color="grey", lw=0.8)
    mark_events(ax, series)
    ax.set_ylabel("busiest expert / mean")
    ax.set_title("Expert load imbalance (1.0 = balanced)")
    return _finish(fig, [ax], path)


# goodput.py's segment kinds; the gaps between them are training (or, at the ends, other time)
SEGMENT_COLOUR = {"checkpoint": "#27ae60", "recovery": "#8e44ad", "lost": "#c0392b", "preflight": "#f1c40f",
                  "startup": "#95a5a6"}


def timeline_figure(series: list[RunSeries], path: Path) -> Path:
    """Wall time since each run's start, one row per run: the non-productive segments as coloured spans over a
    training-coloured bar; failures, swaps and restarts as markers at their times."""
    fig, (ax,) = _figure(height=0.9 + 0.6 * len(series))
    seen: set[str] = set()
    for row, s in enumerate(series):
        t0, t1 = s.span
        ax.broken_barh([(0.0, (t1 - t0) / 60)], (row - 0.3, 0.6), color="#3498db", alpha=0.35,
                       label=None if "train" in seen else "training / other")
        seen.add("train")
        for seg in s.segments:
            ax.broken_barh([((seg.start - t0) / 60, max(seg.seconds, 1e-3) / 60)], (row - 0.3, 0.6),
                           color=SEGMENT_COLOUR.get(seg.kind, "#7f8c8d"), label=None if seg.kind in seen else seg.kind)
            seen.add(seg.kind)
        for ev in s.events:
            if ev.kind in ("failure", "swap", "restart", "stop"):
                colour, _, name = EVENT_STYLE[ev.kind]
                ax.plot([(ev.time - t0) / 60], [row + 0.42], marker="v", color=colour, ls="none",
                        label=None if ev.kind in seen else name)
                seen.add(ev.kind)
    ax.set_yticks(range(len(series)), [s.label for s in series])
    ax.set_ylim(-0.6, len(series) - 0.4 + 0.3)
    ax.set_title("Wall time (goodput: " + ", ".join(f"{s.label} {100 * s.goodput.get('goodput', 0):.0f}%"
                                                     for s in series) + ")")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="x")
    ax.set_xlabel("minutes since the run's first record")
    fig.tight_layout()
    fig.savefig(path)
    return path


def draw_all(series: list[RunSeries], out: Path) -> list[Path]:
    """Every figure the runs have data for, as PNG files in `out`."""
    written = [loss_figure(series, out / "loss.png")]
    for key, ylabel, title, log_y in (("lr", "learning rate", "Learning rate", False),
                                      ("grad_norm", "global grad norm (before clipping)", "Gradient norm", True),
                                      ("tokens_per_s", "tokens / s (all ranks)", "Throughput", False)):
        if _has(series, key):
            written.append(line_figure(series, key, ylabel, title, out / f"{key}.png", log_y=log_y))
    if _has(series, "mfu") or _has(series, "mfu_gemm"):
        written.append(mfu_figure(series, out / "mfu.png"))
    if any(np.isfinite(s.step_time).any() for s in series):
        written.append(line_figure(series, "step_time", "seconds", "Step time", out / "step_time.png"))
    if any(s.load_SLE is not None for s in series):
        written.append(expert_load_figure(series, out / "expert_load.png"))
    if _has(series, "load_max"):
        written.append(balance_figure(series, out / "expert_balance.png"))
    if any(s.span[1] > s.span[0] for s in series):
        written.append(timeline_figure(series, out / "timeline.png"))
    return written
