"""The second start of a run: stop -> the same command again resumes (a stale STOP is cleared), nodes that only failed
a check are checked again while hard failures stay out (and reach the first submission's --exclude), and on
cluster=local the all-to-all checks correctness only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_util import MOE_LAUNCH, wait_for

from moe_launch.conf.schema import AllToAllConfig, ClusterConfig, DcgmConfig, HealthConfig
from moe_launch.health.preflight import run_preflight
from moe_launch.orchestrator.state import NEW_START, Action, replay
from moe_launch.rundir import RunDir, journal_event, read_jsonl

FAKE = str(Path(__file__).parent / "fake_trainer.py")
RUN = ["run.name=r", "train.steps=30", "train.step_sleep_s=0.1", "train.ckpt_interval=4",
       f"supervisor.trainer_command=[{sys.executable},{FAKE}]", "health.preflight=false", "supervisor.poll_s=0.1"]


def test_stop_then_the_same_command_resumes(tmp_path):
    rd = tmp_path / "runs" / "r"
    first = subprocess.Popen([MOE_LAUNCH, *RUN], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: [m for m in read_jsonl(rd / "metrics.jsonl") if m.get("step", 0) >= 9], 90, "step 9")
    stop = subprocess.run([MOE_LAUNCH, "stop", str(rd)], capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert first.wait(timeout=90) == 1
    assert json.loads((rd / "summary.json").read_text())["status"] == "stopped"

    again = subprocess.run([MOE_LAUNCH, *RUN], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_done"] == 30
    assert not (rd / "STOP").exists() and (rd / "summary-0.json").exists()  # the stopped outcome is kept
    steps = [m["step"] for m in read_jsonl(rd / "metrics.jsonl") if "step" in m]
    assert steps.count(1) == 1 and steps[-1] == 30  # resumed from its checkpoint, not from step 0


def _action(kind: str, **kw) -> dict:
    return {"action": Action(kind=kind, **kw).to_json()}


def _journal(rd: RunDir) -> None:
    journal_event(rd, "start", (), handle="1", cluster="slurm")
    journal_event(rd, "allocation", ("node1", "node2", "node3", "node4"), excluded={})
    journal_event(rd, "launch", ("node1", "node3"), **_action(
        "launch", nodes=("node1", "node3"), buffers=("node4",), exclude={"node2": "preflight failed: alltoall slow"}))
    journal_event(rd, "launch", ("node1", "node4"), **_action(
        "relaunch", nodes=("node1", "node4"), buffers=(), exclude={"node3": "node failure (Node failure on node3)"}))
    journal_event(rd, "stop", (), **_action("stop", status="failed", reason="buffers exhausted"))


def test_a_new_start_rechecks_failed_checks_and_keeps_hard_failures(tmp_path):
    rd = RunDir(tmp_path)
    _journal(rd)
    journal_event(rd, "allocation", ("node1", "node2", "node3", "node4"))  # a resubmission: everything carries over
    state = replay(read_jsonl(rd.journal), 2, 5)
    assert set(state.excluded) == {"node2", "node3"} and state.restarts == 1

    journal_event(rd, "info", (), message="started again", **{NEW_START: True})
    journal_event(rd, "start", (), handle="2", cluster="slurm")
    journal_event(rd, "allocation", ("node1", "node2", "node4", "node5"))
    state = replay(read_jsonl(rd.journal), 2, 5)
    assert state.excluded == {"node3": "node failure (Node failure on node3)"}
    assert state.buffers == ("node1", "node2", "node4", "node5") and state.restarts == 0


def test_local_alltoall_checks_correctness_only(tmp_path):
    """A baseline far above what this machine's shared cores give fails the bandwidth judgement; without it (what
    the supervisor asks for on cluster=local) the same nodes pass."""
    cluster = ClusterConfig(kind="local", name="t-corr")
    cfg = HealthConfig(store_dir=str(tmp_path / "store"), gpu_check=False, dcgm=DcgmConfig(enabled=False),
                       alltoall=AllToAllConfig(min_bytes=1024, max_bytes=2048, iters=2, isolate=False,
                                               baseline_path=str(tmp_path / "b.json"), timeout_s=120))
    nodes = ["local1", "local2"]
    assert run_preflight(nodes, cfg, cluster, tmp_path / "h", "rec").ok  # records the baseline
    stored = json.loads((tmp_path / "b.json").read_text())
    for row in stored["alltoall"].values():
        row["busbw_gbs"] *= 1e6
    (tmp_path / "b.json").write_text(json.dumps(stored))
    judged = run_preflight(nodes, cfg, cluster, tmp_path / "h", "judged")
    assert not judged.ok and "below health.alltoall.threshold" in judged.failed["local1"][0]
    correct = run_preflight(nodes, cfg, cluster, tmp_path / "h", "correct", judge_bandwidth=False)
    assert correct.ok and correct.alltoall["baseline_busbw_gbs"] is None


@pytest.mark.slurm
def test_first_submission_of_a_rerun_excludes_earlier_hard_failures(slurm_cluster, tmp_path):
    rd = RunDir(tmp_path / "runs" / "hx")
    _journal(rd)
    proc = subprocess.run([MOE_LAUNCH, "--dry-run", "cluster=slurm", f"run.root={tmp_path / 'runs'}", "run.name=hx"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --exclude=node3" in proc.stdout.splitlines()  # node2 only failed a check: it is checked again
    assert "excluding node(s) that failed in earlier starts of this run: node3 (node failure" in proc.stderr
