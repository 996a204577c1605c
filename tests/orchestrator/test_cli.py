"""The `moe-launch` console script: dry run, bad input failing fast with the key named, Hydra's --help/--cfg/-m,
and the login side's follow loop (status, attach, stop, resubmission after a lost supervisor) on cluster.kind=local
with the contract-following stand-in trainer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_util import MOE_LAUNCH, wait_for

from moe_launch.rundir import read_jsonl

FAKE = str(Path(__file__).parent / "fake_trainer.py")
FAKE_RUN = [f"supervisor.trainer_command=[{sys.executable},{FAKE}]", "health.preflight=false", "supervisor.poll_s=0.1",
            "train.ckpt_interval=4"]


def cli(tmp_path, *args, timeout=60):
    t0 = time.perf_counter()
    proc = subprocess.run([MOE_LAUNCH, *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


def test_dry_run_prints_plan_and_leaves_nothing(tmp_path):
    proc, _ = cli(tmp_path, "--dry-run", "run.name=dry")
    assert proc.returncode == 0, proc.stderr
    assert '"kind": "local"' in proc.stdout and '"local_nodes"' in proc.stdout
    assert not (tmp_path / "runs" / "dry").exists()


@pytest.mark.parametrize("override,key", [("parallel.ep=3", "parallel.ep"), ("cluster.nodes=0", "cluster.nodes"),
                                          ("train.schedule=linear", "train.schedule")])
def test_bad_override_fails_fast_naming_the_key(tmp_path, override, key):
    proc, seconds = cli(tmp_path, override)
    assert proc.returncode == 2 and key in proc.stderr and "Fix:" in proc.stderr
    assert not list((tmp_path / "runs").glob("*")) if (tmp_path / "runs").exists() else True
    print(f"\n{override}: refused in {seconds:.2f} s: {proc.stderr.strip()}")


def test_unknown_key_is_named_by_hydra(tmp_path):
    proc, _ = cli(tmp_path, "cluster.nodez=3")
    assert proc.returncode != 0 and "nodez" in proc.stderr


def test_help_cfg_and_multirun(tmp_path):
    proc, _ = cli(tmp_path, "--help")
    assert proc.returncode == 0 and "cluster: local, slurm" in proc.stdout
    proc, _ = cli(tmp_path, "--cfg", "job", "cluster=slurm")
    assert proc.returncode == 0 and "kind: slurm" in proc.stdout
    proc, _ = cli(tmp_path, "-m", "dry_run=true", "train.steps=5,7")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("# launch plan") == 2


def test_local_run_status_attach_and_stop(tmp_path):
    proc, _ = cli(tmp_path, "run.name=ok", "train.steps=6", "train.step_sleep_s=0.05", *FAKE_RUN, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rd = tmp_path / "runs" / "ok"
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_done"] == 6
    assert {"config.yaml", "journal.jsonl", "metrics.jsonl", "checkpoints", "health", "summary.json"} <= \
        {p.name for p in rd.iterdir()}
    status, _ = cli(tmp_path, "status", str(rd))
    assert status.returncode == 0 and '"status": "completed"' in status.stdout and "local1" in status.stdout
    attach, _ = cli(tmp_path, "attach", str(rd))
    assert attach.returncode == 0 and "run completed" in attach.stderr
    # a long run, stopped from another "login session"
    long = subprocess.Popen([MOE_LAUNCH, "run.name=long", "train.steps=100000", "train.step_sleep_s=0.05", *FAKE_RUN],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rd = tmp_path / "runs" / "long"
    wait_for(lambda: (rd / "metrics.jsonl").exists(), 60, "training")
    stop, _ = cli(tmp_path, "stop", str(rd))
    assert stop.returncode == 0
    assert long.wait(timeout=90) == 1
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps_done"] > 0


def test_lost_supervisor_is_resubmitted_and_the_run_resumes(tmp_path):
    """Second level: the 'allocation' (here the local supervisor process) dies; the login side starts a new one,
    which rebuilds the state from the journal and relaunches the trainer, which resumes from its checkpoint."""
    login = subprocess.Popen([MOE_LAUNCH, "run.name=resub", "train.steps=40", "train.step_sleep_s=0.1", *FAKE_RUN],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rd = tmp_path / "runs" / "resub"
    wait_for(lambda: [m for m in read_jsonl(rd / "metrics.jsonl") if m["step"] >= 9], 60, "step 9")
    first = next(r for r in read_jsonl(rd / "journal.jsonl") if r["kind"] == "allocation")
    os.kill(first["details"]["supervisor_pid"], signal.SIGKILL)
    out, _ = login.communicate(timeout=120)
    print(out[-3000:])
    assert login.returncode == 0
    journal = read_jsonl(rd / "journal.jsonl")
    kinds = [r["kind"] for r in journal]
    assert kinds.count("allocation") == 2 and "resubmit" in kinds
    again = [r for r in journal if r["kind"] == "allocation"][1]
    assert again["details"]["carried_over"] is True
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resubmits"] == 1 and summary["steps_done"] == 40
    assert summary["attempts"] == 2  # attempt numbers continue across allocations
    steps = [m["step"] for m in read_jsonl(rd / "metrics.jsonl")]
    assert steps.count(1) == 1 and steps[-1] == 40  # resumed from a checkpoint, not from scratch


def test_preempted_trainer_is_resubmitted_and_resumes(tmp_path):
    """Slurm's --signal=USR2@N (time limit / preemption) reaches every rank: the trainer checkpoints and exits 4, the
    supervisor ends without a summary, and the login side resubmits."""
    login = subprocess.Popen([MOE_LAUNCH, "run.name=pre", "train.steps=30", "train.step_sleep_s=0.1", *FAKE_RUN],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rd = tmp_path / "runs" / "pre"
    wait_for(lambda: [m for m in read_jsonl(rd / "metrics.jsonl") if m["step"] >= 5], 60, "step 5")
    for path in (rd / "heartbeat").glob("rank*.json"):
        os.kill(json.loads(path.read_text())["pid"], signal.SIGUSR2)
    out, _ = login.communicate(timeout=120)
    print(out[-2000:])
    assert login.returncode == 0
    journal = read_jsonl(rd / "journal.jsonl")
    stop = next(r for r in journal if r["kind"] == "stop" and "action" in r["details"])
    assert stop["details"]["action"]["status"] == "preempted"
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resubmits"] == 1 and summary["restarts"] == 0


@pytest.mark.slurm
def test_slurm_dry_run_and_impossible_requests(slurm_cluster, tmp_path):
    proc, _ = cli(tmp_path, "--dry-run", "run.name=sdry", "cluster=slurm", "cluster.nodes=2", "cluster.buffers=2",
                  "cluster.exclude=[node1]")
    assert proc.returncode == 0, proc.stderr
    for line in ("#SBATCH --nodes=4", "#SBATCH --no-kill", "#SBATCH --no-requeue", "#SBATCH --exclude=node1",
                 "#SBATCH --signal=B:USR2@60"):
        assert line in proc.stdout.splitlines(), line
    proc, _ = cli(tmp_path, "--dry-run", "run.name=sdry", "cluster=slurm", "cluster.exclude=[node1,nosuchnode]")
    assert proc.returncode == 2 and "cluster.exclude" in proc.stderr and "nosuchnode" in proc.stderr  # refused
    squeue = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout
    assert "moe-launch:sdry" not in squeue and not (tmp_path / "runs" / "sdry").exists()
    proc, _ = cli(tmp_path, "cluster=slurm", "cluster.nodes=2", "cluster.buffers=5")
    assert proc.returncode == 2 and "cluster.nodes" in proc.stderr and "refused before submission" in proc.stderr
    proc, _ = cli(tmp_path, "cluster=slurm", "cluster.partition=nope")
    assert proc.returncode == 2 and "cluster.partition" in proc.stderr and "does not exist" in proc.stderr
    proc, _ = cli(tmp_path, "cluster=slurm", "cluster.time_limit_min=1")
    assert proc.returncode == 2 and "cluster.time_limit_min" in proc.stderr
