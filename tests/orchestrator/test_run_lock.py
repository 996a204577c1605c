"""One live start per run directory: a second `moe-launch` of a live run (started together, or again after the login
side was SIGKILLed) refuses naming `moe-launch attach`, and no second allocation is ever made. cluster=local with the
contract-following stand-in trainer; the processes, locks and journal are real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_util import MOE_LAUNCH, wait_for

from moe_launch.orchestrator.runlock import live_allocation, local_supervisors, slurm_jobs_of
from moe_launch.rundir import read_jsonl

FAKE = str(Path(__file__).parent / "fake_trainer.py")
LONG = ["run.name=x", "train.steps=100000", "train.step_sleep_s=0.05", "train.ckpt_interval=4",
        f"supervisor.trainer_command=[{sys.executable},{FAKE}]", "health.preflight=false", "supervisor.poll_s=0.1"]


def _launch(tmp_path: Path, tag: str) -> subprocess.Popen:
    return subprocess.Popen([MOE_LAUNCH, *LONG], cwd=tmp_path, stdout=open(tmp_path / f"{tag}.out", "w"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _starts(rd: Path) -> list[dict]:
    return [r for r in read_jsonl(rd / "journal.jsonl") if r["kind"] == "start"]


def test_second_start_of_a_live_run_refuses_and_names_attach(tmp_path):
    rd = tmp_path / "runs" / "x"
    a, b = _launch(tmp_path, "a"), _launch(tmp_path, "b")  # started together
    try:
        refused = wait_for(lambda: next((p for p in (a, b) if p.poll() is not None), None), 90, "one start refused")
        follower = b if refused is a else a
        tag = "a" if refused is a else "b"
        out = (tmp_path / f"{tag}.out").read_text()
        assert refused.returncode == 2, out
        assert f"moe-launch attach {rd}" in out and "already running" in out
        wait_for(lambda: (rd / "metrics.jsonl").exists(), 60, "training")
        assert len(_starts(rd)) == 1

        # the login side dies (SIGKILL); the allocation (its own session) lives on; the same command again
        follower.kill()
        follower.wait()
        again = subprocess.run([MOE_LAUNCH, *LONG], cwd=tmp_path, capture_output=True, text=True, timeout=90)
        assert again.returncode == 2 and f"moe-launch attach {rd}" in again.stderr, again.stderr
        assert len(_starts(rd)) == 1 and len([r for r in read_jsonl(rd / "journal.jsonl")
                                              if r["kind"] == "allocation"]) == 1

        # a supervisor the journal never heard of (login killed between starting it and journaling it) is found too
        pid = str(next(r for r in read_jsonl(rd / "journal.jsonl") if r["kind"] == "allocation")
                  ["details"]["supervisor_pid"])
        assert local_supervisors(rd) == [pid]
        assert live_allocation(rd, "local", [], lambda *_: False) == f"local supervisor pid {pid}"
    finally:
        stop = subprocess.run([MOE_LAUNCH, "stop", str(rd)], capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        wait_for(lambda: (rd / "summary.json").exists(), 90, "the stopped run's summary")
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait(30)
    assert json.loads((rd / "summary.json").read_text())["status"] == "stopped"
    wait_for(lambda: not local_supervisors(rd), 30, "the supervisor to exit")


def test_slurm_jobs_of_a_run_are_found_by_their_batch_script(tmp_path):
    rd = tmp_path / "runs" / "x"
    lines = (f"11|RUNNING|{rd}/sbatch/allocation-0.sh\n12|PENDING|{rd}/sbatch/allocation-1.sh\n"
             f"13|RUNNING|{tmp_path}/runs/xy/sbatch/allocation-0.sh\n14|COMPLETED|{rd}/sbatch/allocation-2.sh\n"
             "15|RUNNING|(null)\n"
             f"16|COMPLETING|{rd}/sbatch/allocation-3.sh\n")  # its supervisor has exited: a rerun may start
    assert slurm_jobs_of(rd, lines) == ["11", "12"]
    assert live_allocation(rd, "slurm", [{"cluster": "slurm", "handle": "9"}], lambda *_: False,
                           lambda: lines) == "Slurm job 11, 12"
    assert live_allocation(rd, "slurm", [], lambda *_: False, lambda: "") is None


def test_lock_is_released_when_the_holder_dies(tmp_path):
    """A start killed while holding the lock must not block the next one: flock ends with the process."""
    code = ("import sys, time; from pathlib import Path; from moe_launch.orchestrator.runlock import RunLock; "
            "lock = RunLock(Path(sys.argv[1])).__enter__(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    from moe_launch.orchestrator.runlock import RunLock

    with RunLock(tmp_path, wait_s=5):  # raises SubmissionError if the dead holder still held it after 5 s
        pass


@pytest.mark.slurm
def test_second_start_of_a_live_slurm_run_refuses(slurm_cluster, tmp_path):
    """The login side is SIGKILLed while its allocation runs; the same command again must not submit a second job."""
    args = ["cluster=slurm", "cluster.nodes=1", "cluster.buffers=0", "parallel.dp=1", "train.global_batch_size=4",
            "cluster.exclude=[node1,node2,node3,node4]", *LONG]
    first = subprocess.Popen([MOE_LAUNCH, *args], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rd = tmp_path / "runs" / "x"
    try:
        job = wait_for(lambda: next((r["details"]["handle"] for r in read_jsonl(rd / "journal.jsonl")
                                     if r["kind"] == "start"), None), 60, "the allocation")
        first.kill()
        first.wait()
        again = subprocess.run([MOE_LAUNCH, *args], cwd=tmp_path, capture_output=True, text=True, timeout=90)
        assert again.returncode == 2 and f"moe-launch attach {rd}" in again.stderr, again.stderr
        assert f"allocation {job}" in again.stderr or f"Slurm job {job}" in again.stderr
        jobs = subprocess.run(["squeue", "-h", "-n", "moe-launch:x", "-o", "%i"], capture_output=True, text=True)
        assert jobs.stdout.split() == [job] and len(_starts(rd)) == 1
    finally:
        subprocess.run([MOE_LAUNCH, "stop", str(rd)], capture_output=True, timeout=60)
        wait_for(lambda: (rd / "summary.json").exists(), 120, "the stopped run's summary")


@pytest.mark.slurm
@pytest.mark.parametrize("follower", [False, True], ids=["login-side-gone", "login-side-following"])
def test_stop_of_a_pending_slurm_run_records_the_outcome(slurm_cluster, tmp_path, follower):
    """`moe-launch stop` cancels an allocation that has not started; no supervisor ever runs to write summary.json, so
    the login side that follows writes it, or the stop command itself when none follows (it was SIGKILLed)."""
    args = ["cluster=slurm", "cluster.nodes=1", "cluster.buffers=0", "parallel.dp=1", "train.global_batch_size=4",
            "cluster.extra_sbatch=['--begin=now+3600']", *LONG]  # held by its begin time: pending for the whole test
    login = subprocess.Popen([MOE_LAUNCH, *args], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rd = tmp_path / "runs" / "x"
    try:
        job = wait_for(lambda: next((r["details"]["handle"] for r in _starts(rd)), None), 60, "the allocation")
        if not follower:
            login.kill()
            login.wait()
        stop = subprocess.run([MOE_LAUNCH, "stop", str(rd)], capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0 and f"job {job} was pending and is cancelled" in stop.stdout, stop.stderr
        wait_for(lambda: (rd / "summary.json").exists(), 30, "the stopped run's summary")
        summary = json.loads((rd / "summary.json").read_text())
        assert summary["status"] == "stopped" and "before the allocation ran" in summary["reason"]
        assert len([r for r in read_jsonl(rd / "journal.jsonl") if r["kind"] == "stop"]) == 1  # written once
        if follower:
            assert login.wait(30) == 1  # the follower saw the outcome and ended with it
        jobs = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
        assert jobs.stdout.strip() in ("", "CANCELLED")
    finally:
        if login.poll() is None:
            login.kill()
            login.wait()
