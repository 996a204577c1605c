"""Faults of Slurm itself and of several nodes at once: dead spares, a controller outage during a relaunch, an
allocation lost together with its supervisor's node and a spare, and a read-only checkpoint directory. Each survivor
ends bitwise equal to the uninterrupted reference (see harness.py); the storage fault stops with its cause."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
from e2e_util import kill_ranks_on
from harness import (
    RUN_TIMEOUT_S,
    SLOW,
    check_outcome,
    finish,
    journal,
    launches,
    newest_ckpt_before,
    overrides,
    report,
    resumed_after,
    start,
    wait_checkpoint,
    wait_launch,
    wait_step,
)
from slurm.helpers import (
    kill_node,
    restore_nodes,
    run_cmd,
    start_controller,
    stop_controller,
    wait_not_responding,
    wait_sacct_state,
)

pytestmark = pytest.mark.slurm


def _on_nodes(exclude: str, buffers: int, *extra: str) -> list[str]:
    kept = [o for o in overrides(buffers, *extra) if not o.startswith("cluster.exclude=")]
    return [*kept, f"cluster.exclude={exclude}"]


def test_dead_spares_are_probed_before_the_swap_and_peers_are_not_blamed(reference, tmp_path):
    """N=2, B=3; an active node and the first two spares die together. Without a probe the dead spares were swapped
    in one after the other, and srun's "killed" reports of the healthy peer got it excluded."""
    proc, rd = start(tmp_path, "dspare", *_on_nodes("[node1]", 3, SLOW))
    launch = wait_launch(rd)
    active, spares = launch["details"]["action"]["nodes"], launch["details"]["action"]["buffers"]
    victims = [active[1], spares[0], spares[1]]  # active[0] runs the supervisor
    try:
        wait_checkpoint(rd, 3)
        wait_step(rd, 4)
        t_fault = time.time()
        for node in victims:
            kill_node(node)
        code, summary, records = finish(proc, tmp_path, "dspare", RUN_TIMEOUT_S)
    finally:
        restore_nodes(victims, timeout=120)
    assert code == 0, summary
    assert set(victims) <= set(summary["excluded_nodes"]) and active[0] not in summary["excluded_nodes"], summary
    assert summary["final_nodes"] == [active[0], spares[2]], summary
    probe = next(r for r in records if r["kind"] == "failure" and r["details"].get("event") == "NodesLost"
                 and "probe" in r["details"]["detail"])
    assert set(probe["nodes"]) == {spares[0], spares[1]}
    check_outcome(rd, records, summary, reference, restarts=1, swapped=[(active[1], spares[2])])
    report("dead spares", t_fault, records, f" (spares {spares[0]}, {spares[1]} found dead by the probe)")


def test_controller_outage_during_a_relaunch_is_waited_out(reference, tmp_path):
    proc, rd = start(tmp_path, "ctld", *overrides(1, SLOW))
    launch = wait_launch(rd)
    victim = launch["details"]["action"]["nodes"][1]
    restart = None
    try:
        wait_checkpoint(rd, 3)
        wait_step(rd, 4)
        stop_controller()
        t_fault = kill_ranks_on(rd, victim)
        restart = threading.Timer(20, start_controller)
        restart.start()
        code, summary, records = finish(proc, tmp_path, "ctld", RUN_TIMEOUT_S)
    finally:
        if restart is not None:
            restart.join()
        start_controller()
    assert code == 0, summary
    relaunch_log = (rd / "logs" / "attempt1" / "srun.log").read_text(errors="replace")
    # the outage really hit the relaunch
    assert "controller unreachable or step refused for now, srun again" in relaunch_log
    check_outcome(rd, records, summary, reference, restarts=1, swapped=[(victim, launch["details"]["action"]
                                                                           ["buffers"][0])])
    report("controller outage", t_fault, records, " (slurmctld down for 20 s from the kill)")


def test_allocation_lost_with_a_spare_resubmits_with_fewer_buffers(reference, tmp_path):
    """N=2, B=2 on node3..node6: the supervisor's node and the spare die within a second. The partition can then give
    only N nodes: the resubmission asks for B=0 (with a warning), records both dead nodes, and resumes. Slurm may mark
    the two nodes down a ping apart; a resubmission sized in between (B=1) pends on the dead spare, and is cancelled and
    submitted again with B=0 once the spare shows as down."""
    proc, rd = start(tmp_path, "shrink", *overrides(2, SLOW))
    launch = wait_launch(rd)
    host = next(r for r in journal(rd) if r["kind"] == "allocation")["details"]["supervisor_host"]
    spare = launch["details"]["action"]["buffers"][0]
    try:
        wait_checkpoint(rd, 3)
        t_fault = time.time()
        kill_node(host)
        kill_node(spare)
        code, summary, records = finish(proc, tmp_path, "shrink", RUN_TIMEOUT_S)
    finally:
        restore_nodes([host, spare], timeout=120)
    assert code == 0, summary
    resubs = [r for r in records if r["kind"] == "resubmit"]
    resub = resubs[-1]  # the one that ran
    assert resub["details"]["buffers"] == 0 and resub["details"]["continuation"] is False
    if len(resubs) > 1:  # sized before the spare was seen down: cancelled while pending, with a warning saying so
        assert [r["details"]["buffers"] for r in resubs] == [1, 0], resubs
        assert any(r["kind"] == "info" and "cannot start" in r["details"].get("message", "") for r in records)
    assert any(r["kind"] == "info" and r["details"].get("warning") and "buffer" in r["details"]["message"]
               for r in records)
    assert {host, spare} <= set(summary["excluded_nodes"]), summary
    _, trainer = resumed_after(records, resub["time"])
    assert trainer["details"]["step"] == newest_ckpt_before(records, trainer["time"])
    check_outcome(rd, records, summary, reference, restarts=0, swapped=[])
    report("supervisor node and a spare lost", t_fault, records,
           f" (resubmitted with 0 buffers {resub['time'] - t_fault:.1f} s after the kill)")


def test_a_pending_allocation_a_dead_node_blocks_is_cancelled_to_shrink(tmp_path):
    """The login side's check of a pending allocation, on the real controller: N=2 + B=1 sized for node4..node6 pends
    while node6's slurmd is dead; once Slurm reports node6 unavailable it is cancelled, with a warning that says why,
    so that it is submitted again with fewer buffers."""
    from moe_launch.conf.schema import ClusterConfig, ParallelConfig, RootConfig
    from moe_launch.orchestrator import login
    from moe_launch.rundir import RunDir, read_jsonl

    kill_node("node6")
    try:
        wait_not_responding(["node6"])
        script = tmp_path / "job.sh"
        script.write_text("#!/bin/bash\nsleep 120\n")
        job = run_cmd(["sbatch", "--parsable", "-N", "3", "--exclude=node1,node2,node3", "-o", "/dev/null",
                       str(script)]).stdout.strip().split(";")[0]
        rd = RunDir(tmp_path / "run").make()
        cfg = RootConfig(cluster=ClusterConfig(kind="slurm", nodes=2, buffers=1), parallel=ParallelConfig(dp=2))
        last = {"handle": job, "cluster": "slurm", "buffers": 1, "exclude": ["node1", "node2", "node3"]}
        deadline = time.monotonic() + 60
        while not login._pending_replanned(cfg, rd, last):  # asks the controller at most every 5 s
            assert time.monotonic() < deadline, "the pending allocation was never cancelled"
            time.sleep(1)
        info = [r for r in read_jsonl(rd.journal) if r["kind"] == "info"]
        assert info and info[-1]["details"]["warning"] and info[-1]["details"]["message"].startswith(
            f"allocation {job} cannot start: it asks for 3 nodes, the partition has 2 usable (node6 unavailable)")
        assert wait_sacct_state(job, {"CANCELLED"}) == "CANCELLED"
    finally:
        restore_nodes(["node6"], timeout=120)


def test_read_only_checkpoint_directory_stops_naming_the_cause(reference, tmp_path):
    proc, rd = start(tmp_path, "erofs", *overrides(0, SLOW))
    ckpts = rd / "checkpoints"
    mounted = False
    try:
        wait_launch(rd)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(ckpts)], check=True, timeout=30)
        mounted = True
        wait_checkpoint(rd, 3)
        subprocess.run(["mount", "-o", "remount,ro", str(ckpts)], check=True, timeout=30)
        code, summary, records = finish(proc, tmp_path, "erofs", RUN_TIMEOUT_S)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ckpts)], check=False, timeout=30)
    assert code != 0 and summary["status"] == "failed", summary
    assert "checkpoint storage failed" in summary["reason"] and "Read-only file system" in summary["reason"], summary
    assert str(ckpts) in summary["reason"], summary["reason"]
    assert len(launches(records)) == 1, "a storage failure must not cost a relaunch"
    assert summary["checkpoint_step"] == 3 < summary["steps_done"], summary
    print(f"\n[read-only checkpoints] stopped: {summary['reason'][:160]}")
