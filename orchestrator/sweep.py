"""Hydra multirun sweeps of supervised runs: `moe-launch -m model=tiny_dense,tiny_moe train.lr=1e-3,3e-4`.

Every combination is one ordinary run (its own directory under the sweep dir, same contract as runs/<name>, its
own allocation). Hydra's basic launcher calls the task once per combination, in this process:

  cluster.kind=local   the task starts the run and follows it to the end (runs go one after another)
  cluster.kind=slurm   the task submits the allocation and returns; all allocations pend/run together

`SweepCallback.on_multirun_end` (registered by cli.py through hydra.callbacks) then follows every run that has no
summary.json yet (one thread per run, each the same follow loop as `moe-launch attach`, so dead allocations are
resubmitted), and writes the sweep's outcome: a rich table (overrides, status, final loss, tok/s, grad norm, step
time, restarts), <sweep dir>/sweep_summary.json and <sweep dir>/plots/*.png with all runs overlaid (dense vs MoE).

Reading a run directory into a row (`run_row`) is separate from following and from drawing, so the summary of a
sweep can be rebuilt from its directory alone (`summarize(sweep_dir)`).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.experimental.callback import Callback

from moe_launch.rundir import RunDir, read_jsonl, write_json_atomic

SUMMARY_FILE = "sweep_summary.json"


@dataclass
class SweepJob:
    """One combination as the task function saw it. `code`: the task's exit code (2: refused, no run directory)."""

    run_dir: str
    overrides: list[str] = field(default_factory=list)
    code: int = 0
    message: str = ""


_JOBS: list[SweepJob] = []  # filled by the task function (cli.py), read by the callback; same process
RESULT: dict[str, int] = {}  # the callback's exit code for cli.main: 0 when every run completed


def record_job(run_dir: Path, overrides: Sequence[str], code: int, message: str = "") -> None:
    _JOBS.append(SweepJob(str(run_dir), list(overrides), code, message))


def _median(values: list[float]) -> Optional[float]:
    finite = [v for v in values if isinstance(v, (int, float)) and v == v and abs(v) != float("inf")]
    return statistics.median(finite) if finite else None


def run_row(job: SweepJob) -> dict[str, Any]:
    """The sweep table's row of one run, from its directory (summary.json, metrics.jsonl, config.yaml)."""
    from moe_launch.orchestrator.report import last_per_step, read_run

    rd = RunDir(Path(job.run_dir))
    row: dict[str, Any] = {"run": rd.root.name, "run_dir": str(rd.root), "overrides": list(job.overrides)}
    if job.code == 2 or not rd.config.exists():
        return {**row, "status": "refused", "reason": job.message or "the task refused the configuration"}
    try:
        summary = json.loads(rd.summary.read_text())
    except (OSError, ValueError):
        summary = {}
    records = last_per_step([m for m in read_jsonl(rd.metrics) if "step" in m])
    series = read_run(rd.root)
    return {
        **row,
        "model": series.kind,
        "status": summary.get("status", "unfinished"),
        "reason": summary.get("reason", ""),
        "steps_done": summary.get("steps_done", records[-1]["step"] if records else 0),
        "final_loss": records[-1].get("loss") if records else None,
        "final_grad_norm": records[-1].get("grad_norm") if records else None,
        # medians: the first step (compilation, warm-up) and a relaunch gap would dominate a mean of 6 tiny steps
        "tokens_per_s": _median([r.get("tokens_per_s") for r in records]),
        "step_time_s": _median([float(v) for v in series.step_time]),
        "restarts": summary.get("restarts", 0),
        "resubmits": summary.get("resubmits", 0),
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def varied(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Each row's overrides less those every row shares: the table shows what the sweep compares (the shared ones
    go into its caption)."""
    shared = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    return [[o for o in r["overrides"] if o not in shared] for r in rows]


def render_table(rows: list[dict[str, Any]], title: str = "sweep"):
    from rich.table import Table

    shown = varied(rows)
    common = [o for o in rows[0]["overrides"] if all(o not in s for s in shown)] if rows and len(rows) > 1 else []
    table = Table(title=title, caption=("shared: " + " ".join(common)) if common else None)
    for name, justify in (("run", "left"), ("overrides", "left"), ("status", "left"), ("final loss", "right"),
                          ("grad norm", "right"), ("tok/s", "right"), ("step s", "right"), ("restarts", "right")):
        table.add_column(name, justify=justify)
    for r, overrides in zip(rows, shown):
        color = {"completed": "green", "refused": "red", "failed": "red"}.get(r["status"], "yellow")
        table.add_row(r["run"], " ".join(overrides), f"[{color}]{r['status']}[/{color}]",
                      _fmt(r.get("final_loss"), ".4f"), _fmt(r.get("final_grad_norm"), ".3f"),
                      _fmt(r.get("tokens_per_s"), ".0f"), _fmt(r.get("step_time_s"), ".3f"),
                      _fmt(r.get("restarts"), "d"))
    return table


def jobs_in(sweep_dir: Path) -> list[SweepJob]:
    """The runs of a sweep directory, for a summary rebuilt after the fact: subdirectories with a config.yaml, their
    overrides from Hydra's .hydra/overrides.yaml, ordered by Hydra's job number."""
    import yaml

    jobs = []
    for cfg_path in sorted(sweep_dir.glob("*/config.yaml")):
        run = cfg_path.parent
        try:
            overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) or []
            num = int(yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]["job"]["num"])
        except (OSError, ValueError, KeyError, TypeError):
            overrides, num = [], 1 << 30
        jobs.append((num, SweepJob(str(run), [str(o) for o in overrides])))
    return [j for _, j in sorted(jobs, key=lambda nj: (nj[0], nj[1].run_dir))]


def follow_all(jobs: list[SweepJob]) -> None:
    """Follow every started run without a summary.json until it has one (threads: each run's follow loop also
    resubmits its dead allocations, which must not wait on another run finishing)."""
    from moe_launch.conf.load import load_config
    from moe_launch.orchestrator import login

    threads = []
    for job in jobs:
        rd = RunDir(Path(job.run_dir))
        if job.code == 2 or not rd.config.exists() or rd.summary.exists():
            continue
        cfg = load_config(rd.config)
        t = threading.Thread(target=login.follow, args=(cfg, rd, True), name=f"follow-{rd.root.name}", daemon=True)
        t.start()
        threads.append(t)
    if threads:
        print(f"moe-launch: following {len(threads)} run(s) of the sweep to completion", file=sys.stderr)
    for t in threads:
        while t.is_alive():  # join with a timeout so Ctrl-C reaches this (main) thread
            t.join(timeout=1.0)


def summarize(sweep_dir: Path, jobs: Optional[list[SweepJob]] = None, plot: bool = True) -> tuple[list[dict], int]:
    """Rows of every run, sweep_summary.json and plots in `sweep_dir`; exit code 0 iff every run completed."""
    jobs = jobs if jobs is not None else jobs_in(sweep_dir)
    rows = [run_row(j) for j in jobs]
    plots: list[str] = []
    if plot:
        from moe_launch.orchestrator.report import make_plots

        started = [r["run_dir"] for r in rows if r["status"] != "refused"]
        plots = [str(p) for p in make_plots(started, out_dir=sweep_dir / "plots")] if started else []
    code = 0 if rows and all(r["status"] == "completed" for r in rows) else 1
    write_json_atomic(sweep_dir / SUMMARY_FILE, {"sweep_dir": str(sweep_dir), "status": "completed" if code == 0
                                                  else "incomplete", "runs": rows, "plots": plots})
    return rows, code


class SweepCallback(Callback):
    """Registered as hydra.callbacks.moe_launch_sweep by cli.py when `-m` is given."""

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        if OmegaConf.select(config, "dry_run", default=False):  # nothing ran: leave no sweep directory behind
            _JOBS.clear()
            if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {"multirun.yaml"}:
                shutil.rmtree(sweep_dir, ignore_errors=True)
            return
        jobs = list(_JOBS) or jobs_in(sweep_dir)
        _JOBS.clear()
        try:
            follow_all(jobs)
        except KeyboardInterrupt:
            print("\ndetached; the sweep's runs continue. Follow one with `moe-launch attach <run dir>`; the "
                  f"summary is rebuilt by the next `moe-launch -m` or sweep.summarize({str(sweep_dir)!r})",
                  file=sys.stderr)
            RESULT["code"] = 130
            return
        rows, code = summarize(sweep_dir, jobs)
        from rich.console import Console

        Console(width=max(120, Console().width)).print(render_table(rows, title=f"sweep {sweep_dir}"))
        print(f"moe-launch: sweep summary in {sweep_dir / SUMMARY_FILE}, plots in {sweep_dir / 'plots'}",
              file=sys.stderr)
        RESULT["code"] = code
