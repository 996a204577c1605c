"""`moe-launch report runs/<name> [more runs]`: plots and one self-contained report.html per run (or overlay).

  loss.png         LM, aux and z loss per step (three panels; the held-out loss of eval.jsonl on the LM panel)
                   lr.png, grad_norm.png, tokens_per_s.png
  mfu.png          MFU against the data-sheet peak and the preflight-measured GEMM rate (when logged)
  step_time.png    seconds per optimizer step                     expert_load.png  layer x expert load over steps
  expert_balance.png  busiest expert / mean per step
  timeline.png     wall time per run: training, checkpoint stalls, recovery, lost (redone) steps, preflight and
                   startup (orchestrator/goodput.py's segments), with failures, swaps and restarts at their times
Every line plot marks the run's journal events on its step axis: failures and faults, node swaps, restarts and
resubmissions, checkpoints. Legends name what differs between the runs (the sweep's overrides, e.g. train.lr=1e-3).

Reading (this file) is separated from drawing (report_plots.py) and the page (report_html.py): `read_run` turns a run
directory into plain arrays and events, tested on its own. A resumed run logs some steps twice (the steps after the
checkpoint it resumed from); the LAST record of a step wins, since that is the one the surviving trajectory continued
from.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from moe_launch.rundir import RunDir, read_jsonl

# metrics.jsonl key(s) -> RunSeries column; the first key present in a record wins
COLUMNS = {
    "loss": ("lm_loss", "loss"), "total_loss": ("loss",), "aux_loss": ("aux_loss",), "z_loss": ("z_loss",),
    "lr": ("lr",), "grad_norm": ("grad_norm",), "tokens_per_s": ("tokens_per_s",), "mfu": ("mfu",),
    "mfu_gemm": ("mfu_gemm",), "load_max": ("expert_load_max",), "load_mean": ("expert_load_mean",),
    "time": ("time",),
}
# journal kind -> (event class drawn on the plots, label)
EVENT_KINDS = {
    "failure": ("failure", "failure"), "fault": ("failure", "NaN/Inf fault"), "spike": ("failure", "loss spike"),
    "swap": ("swap", "node swap"), "exclude": ("swap", "node excluded"),
    "resume": ("restart", "restart"), "resubmit": ("restart", "resubmission"),
    "checkpoint": ("checkpoint", "checkpoint"), "stop": ("stop", "stop"),
}
_HIDDEN_OVERRIDES = ("run.name=", "run.root=", "hydra.", "++hydra.", "dry_run=")


@dataclass
class Event:
    step: float  # on the step axis (from the event's own step, else interpolated from its time)
    time: float
    kind: str  # failure | swap | restart | checkpoint | stop
    what: str  # label for tables: "node swap: node3 -> node7"


@dataclass
class RunSeries:
    name: str
    kind: str  # dense | moe | ? (config.yaml unreadable)
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cols: dict[str, np.ndarray] = field(default_factory=dict)  # COLUMNS keys, aligned with steps; NaN = not logged
    step_time: np.ndarray = field(default_factory=lambda: np.zeros(0))  # aligned with steps; NaN where unknown
    heldout: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))  # [K, 2] (step, held-out lm loss)
    load_SLE: Optional[np.ndarray] = None  # per logged step (with counts): expert load / layer mean
    load_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))  # the steps of load_SLE
    events: list[Event] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    goodput: dict[str, float] = field(default_factory=dict)  # orchestrator/goodput.py: productive time / wall, ...
    segments: list[Any] = field(default_factory=list)  # goodput.Segment: non-productive stretches of wall time
    span: tuple[float, float] = (0.0, 0.0)  # first and last record time (journal or metrics)
    label: str = ""

    @property
    def load_LE(self) -> Optional[np.ndarray]:
        """[L, E] mean over logged steps of per-expert load / layer mean (1.0 = balanced)."""
        return None if self.load_SLE is None else self.load_SLE.mean(axis=0)


def last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step (the last one written), sorted by step."""
    by_step = {int(r["step"]): r for r in records if isinstance(r.get("step"), (int, float))}
    return [by_step[s] for s in sorted(by_step)]


def _column(records: list[dict[str, Any]], *keys: str) -> np.ndarray:
    """The first of `keys` present in each record, as floats (NaN where none is)."""
    out = []
    for r in records:
        value = next((r[k] for k in keys if isinstance(r.get(k), (int, float)) and not isinstance(r[k], bool)), None)
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


def load_per_step(records: list[dict[str, Any]]) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """(steps, [S, L, E] counts / layer mean count) over the records with expert_counts; None if never logged or
    the shape changed (a different model resumed under the same name)."""
    steps, mats = [], []
    for r in records:
        counts = r.get("expert_counts")
        if not counts:
            continue
        c_LE = np.asarray(counts, dtype=np.float64)
        mean_L1 = c_LE.mean(axis=1, keepdims=True)
        mats.append(np.divide(c_LE, mean_L1, out=np.zeros_like(c_LE), where=mean_L1 > 0))
        steps.append(float(r.get("step", len(steps) + 1)))
    if not mats or len({m.shape for m in mats}) != 1:
        return np.zeros(0), None
    return np.asarray(steps), np.stack(mats)


def bin_steps(steps_S: np.ndarray, load_SLE: np.ndarray, max_bins: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_bins` columns for the heatmap: consecutive logged steps averaged (a 100k-step run would
    otherwise hold S x L x E floats and draw more columns than the figure has pixels)."""
    S = len(steps_S)
    if S <= max_bins:
        return steps_S, load_SLE
    edges = np.linspace(0, S, max_bins + 1).astype(int)
    return (np.array([steps_S[a:b].mean() for a, b in zip(edges, edges[1:])]),
            np.stack([load_SLE[a:b].mean(axis=0) for a, b in zip(edges, edges[1:])]))


def load_matrix(records: list[dict[str, Any]]) -> Optional[np.ndarray]:
    """[L, E] mean over records of counts / mean count of that layer (1.0 = balanced); None if never logged."""
    _, load_SLE = load_per_step(records)
    return None if load_SLE is None else load_SLE.mean(axis=0)


def _describe(kind: str, details: dict[str, Any], nodes: list[str]) -> str:
    label = EVENT_KINDS[kind][1]
    if kind == "swap" and "out" in details:
        return f"{label}: {details.get('out')} -> {details.get('in')}"
    why = details.get("reason") or details.get("what") or details.get("slot") or ""
    where = ", ".join(nodes)
    return ": ".join(x for x in (label, where, str(why)[:160]) if x)


def journal_events(journal: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[Event]:
    """Pure: the journal's failures, swaps, restarts, checkpoints and stops placed on the step axis. An event that
    names its step keeps it; others are interpolated from the metrics' (time, step) pairs."""
    t_S, s_S = _column(records, "time"), _column(records, "step")
    ok = np.isfinite(t_S)
    out = []
    for e in journal:
        if e.get("kind") not in EVENT_KINDS:
            continue
        details = e.get("details") or {}
        t = float(e.get("time", 0.0))
        if isinstance(details.get("step"), (int, float)):
            step = float(details["step"])
        elif ok.any():
            step = float(np.interp(t, t_S[ok], s_S[ok]))
        else:
            step = 0.0
        out.append(Event(step, t, EVENT_KINDS[e["kind"]][0], _describe(e["kind"], details, e.get("nodes") or [])))
    return sorted(out, key=lambda ev: ev.time)


def _kind_of(rd: RunDir) -> str:
    try:
        from omegaconf import OmegaConf

        return str(OmegaConf.select(OmegaConf.load(rd.config), "model.kind", default="?"))
    except Exception:  # a report must not fail on a missing or damaged config file: the plots do not need it
        return "?"


def run_overrides(rd: RunDir) -> list[str]:
    """The command-line overrides the run was started with (Hydra's .hydra/overrides.yaml), less bookkeeping ones."""
    import yaml

    try:
        overrides = yaml.safe_load((rd.root / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in overrides if not str(o).startswith(_HIDDEN_OVERRIDES)]


def legend_labels(series: list[RunSeries]) -> list[str]:
    """What tells the runs apart: the overrides that differ between them (the sweep's values: "train.lr=1e-3"),
    else the run name; a single run is its name (the runs table lists its overrides)."""
    from moe_launch.orchestrator.sweep import varied

    if len(series) == 1:
        return [series[0].name]
    shown = varied([{"overrides": s.overrides} for s in series])
    return [" ".join(o) if o else s.name for s, o in zip(series, shown)]


def read_run(run_dir: str | Path) -> RunSeries:
    from moe_launch.orchestrator.goodput import goodput, timeline

    rd = RunDir(Path(run_dir))
    all_records, journal = read_jsonl(rd.metrics), read_jsonl(rd.journal)
    records = last_per_step(all_records)
    load_steps, load_SLE = load_per_step(records)
    if load_SLE is not None:
        load_steps, load_SLE = bin_steps(load_steps, load_SLE)
    try:
        summary = json.loads(rd.summary.read_text())
    except (OSError, ValueError):
        summary = {}
    s = RunSeries(name=rd.root.name, kind=_kind_of(rd), steps=_column(records, "step"),
                  cols={k: _column(records, *keys) for k, keys in COLUMNS.items()}, step_time=step_times(records),
                  heldout=np.asarray([[r["step"], r["eval_lm_loss"]] for r in last_per_step(read_jsonl(rd.evals))
                                      if isinstance(r.get("eval_lm_loss"), (int, float))], dtype=np.float64
                                     ).reshape(-1, 2),
                  load_SLE=load_SLE, load_steps=load_steps, events=journal_events(journal, records),
                  overrides=run_overrides(rd), summary=summary,
                  # a finished run's own account, else computed the same way from what is on disk so far
                  goodput=summary.get("goodput") or goodput(journal, all_records),
                  segments=timeline(journal, all_records))
    times = [float(r["time"]) for r in (*journal, *all_records) if isinstance(r.get("time"), (int, float))]
    s.span = (min(times), max(times)) if times else (0.0, 0.0)
    s.label = legend_labels([s])[0]
    return s


def make_plots(runs: str | Path | Sequence[str | Path], out_dir: Optional[str | Path] = None) -> list[Path]:
    """Draw the plots and report.html of one run, or of several runs overlaid (e.g. a sweep). Returns the files
    written, by default into <first run>/plots/. Runs without metrics are skipped; no metrics at all writes nothing."""
    from moe_launch.orchestrator.report_html import write_html
    from moe_launch.orchestrator.report_plots import draw_all

    run_dirs = [Path(runs)] if isinstance(runs, (str, Path)) else [Path(r) for r in runs]
    out = Path(out_dir) if out_dir is not None else run_dirs[0] / "plots"
    series = [s for s in map(read_run, run_dirs) if len(s.steps)]
    if not series:
        return []
    for s, label in zip(series, legend_labels(series)):
        s.label = label
    out.mkdir(parents=True, exist_ok=True)
    pngs = draw_all(series, out)
    return [*pngs, write_html(series, pngs, out / "report.html")]


def expand_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories as given; a sweep directory (no run of its own, runs inside) stands for all of its runs."""
    out: list[Path] = []
    for p in map(Path, paths):
        inner = sorted(c.parent for c in p.glob("*/config.yaml"))
        out += inner if not RunDir(p).config.exists() and not RunDir(p).metrics.exists() and inner else [p]
    return out


def main_report(run_dir: str | Path, compare: Sequence[str | Path] = (), out_dir: Optional[str | Path] = None) -> int:
    """`moe-launch report runs/<name> [other runs to overlay]` (or a sweep directory: all its runs overlaid):
    regenerate <first directory>/plots/. Exit 0, or 1 when no run has metrics yet."""
    run_dir = Path(run_dir)
    try:
        paths = make_plots(expand_runs([run_dir, *compare]), out_dir=Path(out_dir) if out_dir else run_dir / "plots")
    except ImportError as e:  # both are dependencies of the package; a trimmed environment gets told what to add
        print(f"moe-launch report needs matplotlib and jinja2 ({e}): pip install matplotlib jinja2", file=sys.stderr)
        return 2
    if not paths:
        print(f"no metrics in {RunDir(run_dir).metrics}: nothing to plot (has the run logged a step yet?)",
              file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main_report(sys.argv[1], sys.argv[2:]))
