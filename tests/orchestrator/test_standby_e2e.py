"""Warm standby end to end on cluster.kind=local with the real trainer: the buffer node's standby takes over the
relaunched rank, and a standby that dies before use is reported and replaced, never handed a rank."""

from __future__ import annotations

import json
import os
import signal

from e2e_util import (
    FAST,
    finish,
    kill_ranks_on,
    metrics_step,
    newest_checkpoint_step,
    start,
    supervisor_resume,
    trainer_resume,
    wait_for,
)

RUN = ["health.preflight=false", "cluster.nodes=1", "cluster.buffers=1", "parallel.dp=1", "supervisor.standby=buffers",
       *FAST]


def _ready(proc, rd, node: str, not_pid: int = -1):
    """The ready standby record of `node` (of another process than `not_pid`), or None; fails if the run ended."""
    assert proc.poll() is None, "moe-launch ended before the standby was ready"
    r = _record(rd, node)
    return r if r is not None and r["state"] == "ready" and r["pid"] != not_pid else None


def _record(rd, node: str):
    try:
        return json.loads((rd / "standby" / f"{node}-l0.json").read_text())
    except (OSError, ValueError):
        return None


def test_relaunch_hands_the_rank_to_the_buffers_standby(tmp_path):
    # checkpoints 5 s apart: the trainer is killed while the standby holds the newest one in memory
    proc, rd = start(tmp_path, "sb", *[o for o in RUN if not o.startswith("train.ckpt_interval")],
                     "train.ckpt_interval=10", "train.steps=30", "train.step_sleep_s=0.5")
    ready = wait_for(lambda: (r := _ready(proc, rd, "local2")) and (r.get("held_step") or 0) >= 10 and r, 300,
                     "standby holding a checkpoint")
    t_kill = kill_ranks_on(rd, "local1")
    code, summary, journal = finish(proc, tmp_path, "sb", 400)
    assert code == 0 and summary["status"] == "completed" and summary["restarts"] == 1
    assert summary["swapped_nodes"] == [{"out": "local1", "in": "local2"}]
    taken = _record(rd, "local2")
    assert taken["state"] == "taken" and taken["pid"] == ready["pid"]  # the warm process, not a new one
    assert "handed to the warm standby local2-l0" in (rd / "logs" / "attempt1" / "local2-rank0.log").read_text()
    restored = trainer_resume(journal, t_kill)
    # resumed from the newest checkpoint, the one the standby held: from memory
    assert restored["details"]["step"] == newest_checkpoint_step(journal, t_kill) == taken["held_step"]
    assert restored["details"]["from_memory"] is True
    resumed = supervisor_resume(journal, t_kill)
    parts = resumed["details"]["breakdown"]
    print(f"\n[local, standby] resumed {resumed['details']['seconds_since_failure']:.1f} s after the failure "
          f"(from memory: {restored['details']['from_memory']}): {parts}")
    # the hand-over replaces interpreter start, imports and the model build: the launched task's only work
    assert parts["process_start"] < 5.0, parts


def test_a_dead_standby_is_reported_and_replaced_never_used(tmp_path):
    proc, rd = start(tmp_path, "sbd", *RUN, "train.steps=40", "train.step_sleep_s=0.5")
    first_standby = wait_for(lambda: _ready(proc, rd, "local2"), 300, "standby ready")
    os.kill(first_standby["pid"], signal.SIGKILL)
    replaced = wait_for(lambda: _ready(proc, rd, "local2", not_pid=first_standby["pid"]), 300, "a new standby")
    (rd / "STOP").write_text("")  # enough: stop the run (moe-launch stop)
    code, summary, journal = finish(proc, tmp_path, "sbd", 300)
    note = next(r for r in journal if "standby on local2 ended before use" in r["details"].get("message", ""))
    assert "replacing it" in note["details"]["message"] and note["nodes"] == ["local2"]
    assert replaced["pid"] != first_standby["pid"]


def test_standby_all_makes_every_rank_of_a_relaunch_warm(tmp_path):
    """supervisor.standby=all: the surviving node's rank is handed to its own standby too (DP=2, one node killed)."""
    proc, rd = start(tmp_path, "sba", "health.preflight=false", "cluster.nodes=2", "cluster.buffers=1",
                     "parallel.dp=2", "supervisor.standby=all", "train.steps=40", "train.step_sleep_s=0.5", *FAST)
    for node in ("local1", "local2", "local3"):
        wait_for(lambda n=node: _ready(proc, rd, n), 300, f"standby on {node}")
    wait_for(lambda: metrics_step(rd) >= 2, 300, "step 2")
    t_kill = kill_ranks_on(rd, "local2")
    code, summary, journal = finish(proc, tmp_path, "sba", 400)
    assert code == 0 and summary["status"] == "completed" and summary["swapped_nodes"] == [
        {"out": "local2", "in": "local3"}]
    for node, rank in (("local1", 0), ("local3", 1)):
        log = (rd / "logs" / "attempt1" / f"{node}-rank{rank}.log").read_text()
        assert f"handed to the warm standby {node}-l0" in log, log[-2000:]
    # local1 had one standby before the relaunch (taken) and one after: a taken standby is not mistaken for the next
    assert len(list((rd / "logs").glob("standby-local1-*"))) == 2
    resumed = supervisor_resume(journal, t_kill)
    print(f"\n[local, standby=all, DP=2] resumed {resumed['details']['seconds_since_failure']:.1f} s after the "
          f"failure: {resumed['details']['breakdown']}")
