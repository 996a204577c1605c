"""The supervisor's standby pool (orchestrator/standby.py): which nodes hold one, and what happens to a standby that
dies before use (journaled, replaced, given up on after MAX_FAILURES), with real local processes."""

from __future__ import annotations

import json
import sys
import time

from moe_launch.conf.schema import SupervisorConfig
from moe_launch.orchestrator.local_cluster import LocalCluster
from moe_launch.orchestrator.standby import MAX_FAILURES, StandbyPool, all_taken, standby_mode, standby_nodes
from moe_launch.rundir import RunDir, read_jsonl


def test_which_nodes_hold_a_standby():
    assert standby_nodes("buffers", ("n1", "n2"), ("n3",)) == ("n3",)
    assert standby_nodes("all", ("n1", "n2"), ("n3",)) == ("n1", "n2", "n3")
    assert standby_nodes("off", ("n1",), ("n3",)) == ()
    # a replaced trainer does not speak the standby protocol
    assert standby_mode(SupervisorConfig(trainer_command=["python", "fake.py"])) == "off"
    assert standby_mode(SupervisorConfig()) == "buffers"


def test_taken_means_taken_by_this_standby_step(tmp_path):
    (tmp_path / "n3-l0.json").write_text(json.dumps({"state": "taken", "id": "1"}))
    assert all_taken(tmp_path, "n3", "1")
    assert not all_taken(tmp_path, "n3", "2")  # the next standby on n3 has not been taken: the record is not its own
    (tmp_path / "n3-l1.json").write_text(json.dumps({"state": "ready", "id": "1"}))
    assert not all_taken(tmp_path, "n3", "1")  # one of two slots still idle
    assert not all_taken(tmp_path, "n4", "1")


def test_a_standby_that_keeps_dying_is_replaced_then_given_up(tmp_path):
    rd = RunDir(tmp_path / "run").make()
    dies_at_once = [sys.executable, "-c", "import sys; sys.exit(3)"]  # the pool appends --standby
    pool = StandbyPool(LocalCluster(("n1", "n2"), 1), rd, dies_at_once, "buffers")
    deadline = time.monotonic() + 60
    while pool.failures.get("n2", 0) < MAX_FAILURES and time.monotonic() < deadline:
        pool.sync(active=("n1",), buffers=("n2",), training=True)
        time.sleep(0.05)
    pool.sync(active=("n1",), buffers=("n2",), training=True)
    assert pool.failures == {"n2": MAX_FAILURES} and pool.started == {"n2": MAX_FAILURES}  # n1 is active: none there
    notes = [r for r in read_jsonl(rd.journal) if "standby on n2" in r["details"].get("message", "")]
    assert len(notes) == MAX_FAILURES and "exit code 3" in notes[0]["details"]["message"]
    assert "replacing it" in notes[0]["details"]["message"] and "starts cold" in notes[-1]["details"]["message"]
    pool.stop()
