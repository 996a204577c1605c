"""Faults 1, 2, 10: a node's trainer processes killed, a node's slurmd stopped, the supervisor's node hard-failed.
Each run must end bitwise equal to the uninterrupted reference (see harness.py)."""

from __future__ import annotations

import time

import pytest
from e2e_util import kill_ranks_on
from harness import (
    RUN_TIMEOUT_S,
    SLOW,
    assert_story,
    check_outcome,
    finish,
    journal,
    newest_ckpt_before,
    overrides,
    report,
    resumed_after,
    start,
    wait_checkpoint,
    wait_launch,
    wait_step,
)
from slurm.helpers import kill_node, restore_nodes, stop_slurmd

pytestmark = pytest.mark.slurm


def test_fault01_hard_kill_of_one_nodes_trainer_processes(reference, tmp_path):
    proc, rd = start(tmp_path, "f01", *overrides(1, SLOW))
    launch = wait_launch(rd)
    victim, spare = launch["details"]["action"]["nodes"][1], launch["details"]["action"]["buffers"][0]
    wait_checkpoint(rd, 3)
    wait_step(rd, 4)
    t_fault = kill_ranks_on(rd, victim)  # mid-way between checkpoints 3 and 6
    code, summary, records = finish(proc, tmp_path, "f01", RUN_TIMEOUT_S)
    assert code == 0, summary
    failure = assert_story(records, victim, ("StepExited", "node failure"), "swap")
    _, trainer = resumed_after(records, failure["time"])
    assert trainer["details"]["step"] == newest_ckpt_before(records, trainer["time"])
    assert victim in summary["excluded_nodes"]
    check_outcome(rd, records, summary, reference, restarts=1, swapped=[(victim, spare)])
    report("01 node processes killed", t_fault, records)


def test_fault02_slurmd_of_one_node_stopped(reference, tmp_path):
    proc, rd = start(tmp_path, "f02", *overrides(1, "train.step_sleep_s=4"))
    launch = wait_launch(rd)
    victim, spare = launch["details"]["action"]["nodes"][1], launch["details"]["action"]["buffers"][0]
    try:
        wait_checkpoint(rd, 3)
        t_fault = time.time()
        # its tasks keep running; Slurm marks it not responding after SlurmdTimeout (10 s on the test cluster), so
        # the steps are slowed (4 s each) to leave the run unfinished until then
        stop_slurmd(victim)
        code, summary, records = finish(proc, tmp_path, "f02", RUN_TIMEOUT_S)
    finally:
        restore_nodes([victim], timeout=120)
    assert code == 0, summary
    failure = assert_story(records, victim, ("NodesLost", "StepExited"), "swap")
    _, trainer = resumed_after(records, failure["time"])
    assert trainer["details"]["step"] == newest_ckpt_before(records, trainer["time"])
    assert victim in summary["excluded_nodes"]
    check_outcome(rd, records, summary, reference, restarts=1, swapped=[(victim, spare)])
    report("02 slurmd stopped", t_fault, records, f" (detected {failure['time'] - t_fault:.1f} s after the stop)")


def test_fault10_supervisor_node_lost_login_side_resubmits(reference, tmp_path):
    proc, rd = start(tmp_path, "f10", *overrides(1, SLOW))
    wait_launch(rd)
    alloc = next(r for r in journal(rd) if r["kind"] == "allocation")
    host = alloc["details"]["supervisor_host"]
    try:
        wait_checkpoint(rd, 3)
        t_fault = time.time()
        kill_node(host)  # slurmd, the batch step (the supervisor) and the trainer rank on that node
        code, summary, records = finish(proc, tmp_path, "f10", RUN_TIMEOUT_S)
    finally:
        restore_nodes([host], timeout=120)
    assert code == 0, summary
    resub = next(r for r in records if r["kind"] == "resubmit")
    assert resub["details"]["previous_supervisor_host"] == host
    allocs = [r for r in records if r["kind"] == "allocation"]
    assert len(allocs) == 2 and host not in allocs[1]["nodes"], allocs
    assert summary["resubmits"] == 1
    _, trainer = resumed_after(records, resub["time"])
    assert trainer["details"]["step"] == newest_ckpt_before(records, trainer["time"])
    check_outcome(rd, records, summary, reference, restarts=0, swapped=[])
    report("10 supervisor node lost", t_fault, records,
           f" (allocation end seen and resubmitted {resub['time'] - t_fault:.1f} s after the kill)")
