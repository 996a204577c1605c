"""End to end on cluster.kind=local with the real trainer: `make run`'s default composition completes, and a local
"node" whose processes are killed mid-run is excluded, a buffer takes its place and training resumes."""

from __future__ import annotations

import math
import time

import pytest
from e2e_util import (
    FAST,
    finish,
    first,
    kill_ranks_on,
    metrics_step,
    newest_checkpoint_step,
    start,
    supervisor_resume,
    trainer_resume,
    wait_for,
)

from moe_launch.rundir import read_jsonl


def test_local_node_killed_is_swapped_and_run_completes(tmp_path):
    # slow steps, and the kill only once a checkpoint is durable: the resume must come from it (a kill while the
    # first one still persists rightly restarts from scratch, and tests nothing)
    proc, rd = start(tmp_path, "lkill", "health.preflight=false", "train.steps=8", "train.step_sleep_s=0.3", *FAST)
    wait_for(lambda: metrics_step(rd) >= 4 and newest_checkpoint_step(read_jsonl(rd / "journal.jsonl"), math.inf),
             300, "step 4 and a checkpoint")
    t_kill = kill_ranks_on(rd, "local2")
    code, summary, journal = finish(proc, tmp_path, "lkill", 400)
    assert code == 0 and summary["status"] == "completed" and summary["steps_done"] == 8
    assert summary["excluded_nodes"] == ["local2"] and summary["swapped_nodes"] == [{"out": "local2", "in": "local3"}]
    seen = first(journal, "failure", t_kill)
    assert "local2" in seen["nodes"]
    resumed_at = trainer_resume(journal, seen["time"])
    assert resumed_at["details"]["step"] == newest_checkpoint_step(journal, resumed_at["time"])
    resumed = supervisor_resume(journal, t_kill)
    print(f"\n[local, local2 killed] detected after {seen['time'] - t_kill:.1f} s; training resumed "
          f"{resumed['time'] - t_kill:.1f} s after the kill")


@pytest.mark.slow
def test_make_run_default_completes(tmp_path):
    """Exactly what `make run` runs (the embedded default: tiny MoE, built-in corpus, local cluster, preflight on)."""
    t0 = time.time()
    # only the health history and all-to-all baselines are made private to the test: a baseline recorded earlier on
    # this shared machine under another load would judge this run's loopback "network" against the wrong numbers
    proc, rd = start(tmp_path, "default", f"health.alltoall.baseline_path={tmp_path / 'a2a.json'}",
                     f"health.store_dir={tmp_path / 'health'}")
    code, summary, journal = finish(proc, tmp_path, "default", 900)
    print(f"\n`moe-launch` default run: {time.time() - t0:.0f} s wall, status {summary['status']}, "
          f"{summary['steps_done']} steps, final loss {summary['final_loss']}")
    assert code == 0 and summary["status"] == "completed"
    assert any(r["kind"] == "preflight" for r in journal)
