"""Plots of finished (or running) runs: `moe-launch report runs/<name>` -> runs/<name>/plots/*.png.

  loss.png          LM loss per step; one line per run, so a dense baseline and its MoE overlay in one figure
  grad_norm.png     global gradient norm per step (the handbook compares it between dense and MoE)
  step_time.png     seconds per optimizer step (step_time_s when logged, else from the records' wall times)
  expert_load.png   heatmap layer x expert of load / mean load over the run (needs `expert_counts` in metrics)
  expert_balance.png  busiest expert / mean per step (expert_load_max, expert_load_mean) for MoE runs

Reading is separated from drawing: `read_run` turns a run directory into plain arrays (tested on its own),
`make_plots` draws them with matplotlib's object API (no pyplot global state, no display needed).
A resumed run logs some steps twice (the steps after the checkpoint it resumed from); the LAST record of a step
wins, since that is the one the surviving trajectory continued from.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from moe_launch.rundir import RunDir, read_jsonl


@dataclass
class RunSeries:
    name: str
    kind: str  # dense | moe | ? (config.yaml unreadable)
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    loss: np.ndarray = field(default_factory=lambda: np.zeros(0))
    grad_norm: np.ndarray = field(default_factory=lambda: np.zeros(0))
    step_time: np.ndarray = field(default_factory=lambda: np.zeros(0))  # aligned with steps; NaN where unknown
    load_max: np.ndarray = field(default_factory=lambda: np.zeros(0))
    load_mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    load_LE: Optional[np.ndarray] = None  # mean over logged steps of per-expert load / layer mean

    @property
    def label(self) -> str:
        return self.name if self.kind in ("?", "") or self.kind in self.name else f"{self.name} ({self.kind})"


def last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step (the last one written), sorted by step."""
    by_step = {int(r["step"]): r for r in records if isinstance(r.get("step"), (int, float))}
    return [by_step[s] for s in sorted(by_step)]


def _column(records: list[dict[str, Any]], *keys: str) -> np.ndarray:
    """The first of `keys` present in each record, as floats (NaN where none is)."""
    out = []
    for r in records:
        value = next((r[k] for k in keys if isinstance(r.get(k), (int, float))), None)
        out.append(float(value) if value is not None else np.nan)
    return np.asarray(out, dtype=np.float64)


def step_times(records: list[dict[str, Any]]) -> np.ndarray:
    """step_time_s where logged; otherwise wall time between consecutive records / steps between them. The first
    record (and the first after a restart, whose gap includes the relaunch) has no reliable time: NaN."""
    logged = _column(records, "step_time_s")
    if not np.isnan(logged).all():
        return logged
    t, s = _column(records, "time"), _column(records, "step")
    dt = np.full(len(records), np.nan)
    if len(records) > 1:
        dt[1:] = np.diff(t) / np.maximum(np.diff(s), 1)
    # a restart shows as a gap far above the typical step: drop it rather than plot minutes of relaunch as a step
    finite = dt[np.isfinite(dt)]
    if finite.size >= 3:
        dt[dt > 20 * np.median(finite)] = np.nan
    return dt


def load_matrix(records: list[dict[str, Any]]) -> Optional[np.ndarray]:
    """[L, E] mean over records of counts / mean count of that layer (1.0 = balanced); None if never logged."""
    mats = []
    for r in records:
        counts = r.get("expert_counts")
        if not counts:
            continue
        c_LE = np.asarray(counts, dtype=np.float64)
        mean_L1 = c_LE.mean(axis=1, keepdims=True)
        mats.append(np.divide(c_LE, mean_L1, out=np.zeros_like(c_LE), where=mean_L1 > 0))
    if not mats or len({m.shape for m in mats}) != 1:
        return None
    return np.mean(mats, axis=0)


def _kind_of(rd: RunDir) -> str:
    try:
        from omegaconf import OmegaConf

        return str(OmegaConf.select(OmegaConf.load(rd.config), "model.kind", default="?"))
    except Exception:  # a report must not fail on a missing or damaged config file: the plots do not need it
        return "?"


def read_run(run_dir: str | Path) -> RunSeries:
    rd = RunDir(Path(run_dir))
    records = last_per_step(read_jsonl(rd.metrics))
    return RunSeries(
        name=rd.root.name, kind=_kind_of(rd), steps=_column(records, "step"), loss=_column(records, "lm_loss", "loss"),
        grad_norm=_column(records, "grad_norm"), step_time=step_times(records),
        load_max=_column(records, "expert_load_max"), load_mean=_column(records, "expert_load_mean"),
        load_LE=load_matrix(records),
    )


def _line_plot(series: list[RunSeries], attr: str, ylabel: str, title: str, path: Path, log_y: bool = False) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.add_subplot()
    for s in series:
        y = getattr(s, attr)
        ok = np.isfinite(y)
        ax.plot(s.steps[ok], y[ok], marker="." if ok.sum() < 40 else None, label=s.label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def _heatmaps(series: list[RunSeries], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 2.2 + 2.0 * len(series)), dpi=110)
    axes = fig.subplots(len(series), 1, squeeze=False)[:, 0]
    for ax, s in zip(axes, series):
        L, E = s.load_LE.shape
        im = ax.imshow(s.load_LE, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(f"{s.label}: expert load / mean, averaged over {len(s.steps)} logged steps")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_yticks(range(L))
        fig.colorbar(im, ax=ax, label="load / mean")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _balance(series: list[RunSeries], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.add_subplot()
    for s in series:
        for y, style, what in ((s.load_max, "-", "max over layers"), (s.load_mean, "--", "mean over layers")):
            ok = np.isfinite(y)
            ax.plot(s.steps[ok], y[ok], style, label=f"{s.label}, {what}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert / mean")
    ax.set_title("Expert load imbalance (1.0 = balanced)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def make_plots(runs: str | Path | Sequence[str | Path], out_dir: Optional[str | Path] = None) -> list[Path]:
    """Draw the plots of one run, or of several runs overlaid (e.g. a dense/MoE sweep). Returns the files written,
    by default into <first run>/plots/. Runs without metrics are skipped; no metrics at all writes nothing."""
    run_dirs = [Path(runs)] if isinstance(runs, (str, Path)) else [Path(r) for r in runs]
    out = Path(out_dir) if out_dir is not None else run_dirs[0] / "plots"
    series = [s for s in map(read_run, run_dirs) if len(s.steps)]
    if not series:
        return []
    out.mkdir(parents=True, exist_ok=True)
    title = " vs ".join(s.label for s in series)
    written = [
        _line_plot(series, "loss", "LM loss", f"Loss: {title}", out / "loss.png"),
        _line_plot(series, "grad_norm", "global grad norm (before clipping)", "Gradient norm", out / "grad_norm.png"),
    ]
    if any(np.isfinite(s.step_time).any() for s in series):
        written.append(_line_plot(series, "step_time", "seconds", "Step time", out / "step_time.png"))
    with_counts = [s for s in series if s.load_LE is not None]
    if with_counts:
        written.append(_heatmaps(with_counts, out / "expert_load.png"))
    with_balance = [s for s in series if np.isfinite(s.load_max).any()]
    if with_balance:
        written.append(_balance(with_balance, out / "expert_balance.png"))
    return written


def main_report(run_dir: str | Path, compare: Sequence[str | Path] = (), out_dir: Optional[str | Path] = None) -> int:
    """`moe-launch report runs/<name> [other runs to overlay]`: regenerate runs/<name>/plots/. Exit 0, or 1 when
    the run has no metrics yet."""
    run_dir = Path(run_dir)
    paths = make_plots([run_dir, *compare], out_dir=Path(out_dir) if out_dir else run_dir / "plots")
    if not paths:
        print(f"no metrics in {RunDir(run_dir).metrics}: nothing to plot (has the run logged a step yet?)",
              file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main_report(sys.argv[1], sys.argv[2:]))
