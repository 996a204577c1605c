"""Job scripts for submission by hand (`--render-sbatch`, `--render-preflight`), rendered from the same plan."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_launch.conf.load import load_config
from moe_launch.orchestrator import login
from moe_launch.orchestrator.render import render_preflight_sbatch, render_sbatch

MOE_LAUNCH = [sys.executable, "-m", "moe_launch.orchestrator.cli"]
BASE = ["cluster=slurm", "cluster.nodes=2", "cluster.buffers=0", "parallel.dp=2"]


def _render(tmp_path: Path, flag: str, name: str, extra=()) -> tuple[Path, str]:
    out = subprocess.run([*MOE_LAUNCH, flag, *BASE, f"run.name={name}", *extra], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return tmp_path / "runs" / name, out.stdout


@pytest.mark.slurm
def test_render_sbatch_writes_config_and_the_plans_script(tmp_path, slurm_cluster):  # reads partitions with sinfo
    run_dir, printed = _render(tmp_path, "--render-sbatch", "hand")
    cfg = load_config(run_dir / "config.yaml")
    script = (run_dir / "sbatch" / "job.sbatch").read_text()
    assert script == render_sbatch(login.make_plan(cfg, run_dir))  # the same plan code as moe-launch itself
    assert script.strip() in printed
    assert "#SBATCH --no-kill" in script and "#SBATCH --no-requeue" in script
    assert not (run_dir / "journal.jsonl").exists()  # nothing was submitted


def test_render_needs_a_slurm_cluster(tmp_path):
    out = subprocess.run([*MOE_LAUNCH, "--render-sbatch", "run.name=x"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "render_sbatch" in out.stderr


@pytest.mark.slurm
def test_preflight_only_job_runs_on_the_cluster(tmp_path, slurm_cluster):
    run_dir, _ = _render(tmp_path, "--render-preflight", "pf", [
        f"health.alltoall.baseline_path={tmp_path}/baselines.json", f"health.store_dir={tmp_path}/store"])
    script = run_dir / "sbatch" / "preflight.sbatch"
    assert script.read_text() == render_preflight_sbatch(login.make_plan(load_config(run_dir / "config.yaml"),
                                                                         run_dir))
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True,
                         timeout=60).stdout.strip().split(";")[0]
    deadline, state = time.monotonic() + 240, ""
    while time.monotonic() < deadline:
        show = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        state = next((w.split("=")[1] for w in show.split() if w.startswith("JobState=")), state)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        time.sleep(2)
    log = next((run_dir / "logs").glob(f"allocation-{job}.out"), None)
    assert state == "COMPLETED", (state, log.read_text()[-3000:] if log else "no log")
    import json

    result = json.loads((run_dir / "health" / "preflight.json").read_text())
    assert len(result["healthy"]) == 2 and not result["failed"], result
