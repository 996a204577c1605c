"""In-run blame for a hang inside a collective (every rank stops at the same step): the supervisor probes the job's
nodes (compute check, all-to-all with isolation) before relaunching, swaps out the node the probe convicts, and
relaunches on the same nodes only when all pass. Convictions during the run land in the health history."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from e2e_util import MOE_LAUNCH, wait_for

from moe_launch.conf.schema import HealthConfig
from moe_launch.health import store
from moe_launch.health.dcgm import DCGMI_DIR_ENV
from moe_launch.health.dcgm_double import install_double
from moe_launch.orchestrator.decide import decide
from moe_launch.orchestrator.events import Hang, PreflightDone, Probed
from moe_launch.orchestrator.state import Action, apply, in_run_blame, initial_state
from moe_launch.rundir import read_jsonl

FAKE = str(Path(__file__).parent / "fake_trainer.py")


def _step(state, event):
    action = decide(state, event)
    return apply(state, action), action


def _running(max_restarts=5):
    s, _ = _step(initial_state(2, max_restarts, ["n1", "n2", "n3"]), PreflightDone(healthy=("n1", "n2", "n3")))
    return s


def test_a_hang_nobody_is_blamed_for_probes_then_swaps_the_convicted_node():
    s, a = _step(_running(), Hang(attempt=0, suspects=(), step=6, idle_s=30))
    assert a.kind == "update" and a.probe == ("n1", "n2") and s.active == ("n1", "n2") and s.restarts == 0
    s, a = _step(s, Probed(attempt=0, step=6, healthy=("n1",), failed={"n2": "dcgm: Row Remap failure"}))
    assert a.kind == "relaunch" and a.swaps == (("n2", "n3"),) and s.active == ("n1", "n3")
    assert "n2" in s.excluded and "Row Remap" in s.excluded["n2"] and s.restarts == 1


def test_a_hang_with_every_node_passing_the_probe_relaunches_on_the_same_nodes():
    s, _ = _step(_running(), Hang(attempt=0, suspects=("n1", "n2"), step=6, idle_s=30))
    s, a = _step(s, Probed(attempt=0, step=6, healthy=("n1", "n2")))
    assert a.kind == "relaunch" and s.active == ("n1", "n2") and "passed the probe" in a.reason


def test_no_probe_once_restarts_are_used_up():
    s, a = _step(_running(max_restarts=0), Hang(attempt=0, suspects=(), step=6, idle_s=30))
    assert a.kind == "stop" and not a.probe


def test_collective_hang_is_blamed_on_the_node_the_probe_convicts(tmp_path):
    doubles = tmp_path / "doubles"
    for node in ("local1", "local2", "local3"):
        install_double(doubles, node, "dcgm_pass.json")
    env = {**os.environ, "PATH": "/usr/bin:/bin", DCGMI_DIR_ENV: str(doubles), "FAKE_TRAINER_ALL_RANKS": "1"}
    args = ["run.name=h", "train.steps=12", "train.step_sleep_s=0.1", "train.ckpt_interval=2",
            f"supervisor.trainer_command=[{sys.executable},{FAKE}]", "supervisor.poll_s=0.1",
            "supervisor.hang_timeout_s=3", "train.fault_injection.kind=hang", "train.fault_injection.step=6",
            "health.alltoall.max_bytes=4096", "health.alltoall.iters=2", f"health.store_dir={tmp_path / 'store'}"]
    login = subprocess.Popen([MOE_LAUNCH, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    rd = tmp_path / "runs" / "h"
    try:
        wait_for(lambda: [r for r in read_jsonl(rd / "journal.jsonl") if r["kind"] == "launch"], 120, "the launch")
        # local2 goes bad while training: only a probe can find it (its ranks stop together with local1's)
        install_double(doubles, "local2", "dcgm_fail_memory.json", returncode=226)
        out, _ = login.communicate(timeout=240)
    finally:
        if login.poll() is None:
            login.kill()
    print(out[-4000:])
    assert login.returncode == 0
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_nodes"] == ["local1", "local3"]
    journal = read_jsonl(rd / "journal.jsonl")
    probe = next(r for r in journal if r["details"].get("event") == "Probed")
    assert list(probe["details"]["failed"]) == ["local2"]
    swap = next(r for r in journal if r["kind"] == "swap")
    assert swap["details"]["out"] == "local2" and swap["details"]["buffer_in"] == "local3"
    history = read_jsonl(tmp_path / "store" / "local" / "history.jsonl")
    blamed = [h for h in history if h["check"] == "in_run"]
    assert [h["node"] for h in blamed] == ["local2"] and "probe failed" in blamed[0]["reasons"][0]


def test_in_run_blame_counts_towards_quarantine(tmp_path):
    s, a = _step(_running(), Hang(attempt=0, suspects=(), step=6, idle_s=30))
    s, a = _step(s, Probed(attempt=0, step=6, healthy=("n1",), failed={"n2": "dcgm: Row Remap failure"}))
    assert in_run_blame(a) == {"n2": a.exclude["n2"]}
    assert in_run_blame(Action(kind="launch", exclude={"n9": "preflight failed: dcgm"})) == {}  # preflight's own
    cfg = HealthConfig(store_dir=str(tmp_path), quarantine_failures=2)
    for run in ("r1", "r2"):
        store.record_in_run(tmp_path / "c", cfg, in_run_blame(a), run)
    assert store.quarantined_nodes(tmp_path / "c")["n2"]["failures"] == 2
