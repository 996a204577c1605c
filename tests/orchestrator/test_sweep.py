"""Hydra multirun sweeps of supervised runs, end to end through the real `moe-launch` console script and trainer,
started from a fresh working directory (Hydra's output dirs are relative to it): every combination is its own run
directory with the usual contract, and the sweep ends with a table, sweep_summary.json and overlaid plots."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from e2e_util import FAST, MOE_LAUNCH

from moe_launch.conf.load import load_config
from moe_launch.orchestrator import sweep

TINY = ["train.steps=6", "health.preflight=false", *FAST]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_sweep(cwd: Path, *overrides: str, timeout: float) -> tuple[int, str]:
    proc = subprocess.run([MOE_LAUNCH, *overrides, "-m"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, timeout=timeout)
    out = proc.stdout.decode(errors="replace")
    print(out[-8000:])
    return proc.returncode, out


def check_sweep(sweep_dir: Path, out: str, n_runs: int) -> dict:
    """The contract every sweep meets: one directory per run (unique run name), all completed, summary and plots."""
    summary = json.loads((sweep_dir / sweep.SUMMARY_FILE).read_text())
    runs = summary["runs"]
    assert summary["status"] == "completed" and len(runs) == n_runs
    names = [r["run"] for r in runs]
    assert names == [f"{sweep_dir.name}-{i}" for i in range(n_runs)]  # `${run.name}-<job num>`, Hydra's job order
    for r in runs:
        run_dir = Path(r["run_dir"])
        assert run_dir.parent == sweep_dir
        assert (run_dir / "config.yaml").exists() and (run_dir / "journal.jsonl").exists()
        assert r["status"] == "completed" and r["steps_done"] == 6 and r["restarts"] == 0
        assert r["final_loss"] > 0 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["final_grad_norm"] > 0
        assert r["run"] in out  # the table names every run
        # the run's own config carries its unique name (so Slurm job names and health records differ per run)
        assert f"name: {r['run']}" in (run_dir / "config.yaml").read_text()
    for png in ("loss.png", "grad_norm.png"):
        data = (sweep_dir / "plots" / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000
    assert "sweep summary in" in out and "final loss" in out
    # the summary can be rebuilt from the directory alone (Hydra's .hydra/overrides.yaml of each run)
    rebuilt, code = sweep.summarize(sweep_dir, plot=False)
    assert code == 0 and [r["overrides"] for r in rebuilt] == [r["overrides"] for r in runs]
    return summary


def test_local_sweep_dense_vs_moe_one_command(tmp_path):
    """The handbook's comparison: dense baseline and MoE, identical data/batch/optimizer, one command."""
    code, out = run_sweep(tmp_path, "model=tiny_dense,tiny_moe", "run.name=cmp", *TINY, timeout=300)
    assert code == 0
    summary = check_sweep(tmp_path / "runs" / "cmp", out, 2)
    assert [r["model"] for r in summary["runs"]] == ["dense", "moe"]
    # the table shows what differs; the shared settings (same batch, data, optimizer) go to its caption
    assert sweep.varied(summary["runs"]) == [["model=tiny_dense"], ["model=tiny_moe"]]
    assert "shared: run.name=cmp train.steps=6" in out
    assert (tmp_path / "runs" / "cmp" / "plots" / "expert_balance.png").exists()  # the MoE run's load balance


def test_dry_run_sweep_plans_each_combination_and_leaves_nothing(tmp_path):
    """`-m` after the overrides and `--dry-run` among them (Hydra wants its flags first; the entry point reorders)."""
    code, out = run_sweep(tmp_path, "--dry-run", "model=tiny_dense,tiny_moe", "run.name=dry", timeout=120)
    assert code == 0 and out.count("# launch plan") == 2
    assert '"run_name": "dry-0"' in out and '"run_name": "dry-1"' in out
    assert not (tmp_path / "runs" / "dry").exists()


def test_refused_combination_is_reported_and_fails_the_sweep(tmp_path):
    """A combination refused before submission (top_k above the expert count) leaves no run, shows as refused in
    the table and the summary, and makes the sweep exit 2; the other combination still runs."""
    code, out = run_sweep(tmp_path, "model.moe.top_k=1,9", "run.name=bad", *TINY, timeout=300)
    assert code == 2
    runs = json.loads((tmp_path / "runs" / "bad" / sweep.SUMMARY_FILE).read_text())["runs"]
    assert [r["status"] for r in runs] == ["completed", "refused"]
    assert not (tmp_path / "runs" / "bad" / "bad-1").exists() and "refused" in out


@pytest.mark.slurm
def test_slurm_sweep_2x2_submits_all_then_follows(slurm_cluster, tmp_path):
    """2 models x 2 learning rates on the local Slurm cluster: each combination its own 1-node allocation, all
    submitted before the sweep follows any of them, then the table and summary."""
    code, out = run_sweep(tmp_path, "cluster=slurm", "cluster.nodes=1", "cluster.buffers=0", "parallel.dp=1",
                          "model=tiny_dense,tiny_moe", "train.lr=1e-3,3e-4", "run.name=sw", *TINY, timeout=540)
    assert code == 0
    summary = check_sweep(tmp_path / "runs" / "sw", out, 4)
    assert sweep.varied(summary["runs"]) == [  # as Hydra writes the swept values
        ["model=tiny_dense", "train.lr=0.001"], ["model=tiny_dense", "train.lr=0.0003"],
        ["model=tiny_moe", "train.lr=0.001"], ["model=tiny_moe", "train.lr=0.0003"]]
    lrs = [load_config(Path(r["run_dir"]) / "config.yaml").train.lr for r in summary["runs"]]
    assert lrs == [1e-3, 3e-4, 1e-3, 3e-4]  # each run trained with its own combination
    handles = []
    for r in summary["runs"]:
        journal = [json.loads(line) for line in (Path(r["run_dir"]) / "journal.jsonl").read_text().splitlines()]
        handles.append(next(j["details"]["handle"] for j in journal if j["kind"] == "start"))
    assert len(set(handles)) == 4  # four allocations
    started = [i for i, line in enumerate(out.splitlines()) if "started (slurm:" in line]
    finished = [i for i, line in enumerate(out.splitlines()) if line.startswith("run completed")]
    assert len(started) == 4 and len(finished) == 4 and max(started) < min(finished)
