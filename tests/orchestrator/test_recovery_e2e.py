"""End to end on cluster.kind=local with the real trainer: a rank SIGKILLed mid-run is recovered, and the
supervisor's resume record says where the recovery's seconds went."""

from __future__ import annotations

import pytest
from e2e_util import FAST, finish, first, start, supervisor_resume

from moe_launch.orchestrator.recovery import PHASES


def test_resume_record_breaks_the_recovery_down(tmp_path):
    # rank 1 dies as step 6 starts, after the checkpoint at step 3: rank 0 logged step 4 before step 5's collectives
    # (which rank 1 waited for), so at least one logged step is computed again; step 5's row may be lost with rank 0
    inject = ["train.fault_injection.kind=sigkill", "train.fault_injection.rank=1", "train.fault_injection.step=6"]
    proc, rd = start(tmp_path, "rbd", "health.preflight=false", "cluster.nodes=2", "cluster.buffers=1",
                     "train.steps=7", *FAST, *inject)
    code, summary, journal = finish(proc, tmp_path, "rbd", 400)
    assert code == 0 and summary["status"] == "completed" and summary["restarts"] == 1
    failure = first(journal, "failure")
    resumed = supervisor_resume(journal, failure["time"])
    parts = resumed["details"]["breakdown"]
    assert set(parts) == set(PHASES), parts  # the trainer's start record was found for this attempt
    assert all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(resumed["details"]["seconds_since_failure"], abs=0.01)
    # a new process: an interpreter start and imports, a checkpoint read; nothing compiled (train.compile is off)
    assert parts["process_start"] > 0 and parts["restore"] > 0 and parts["compile"] == 0
    # the failure counts from the killed attempt's last heartbeat (step 5), not from the supervisor noticing it
    assert parts["detect"] > 0
    g = summary["goodput"]  # the recovery and the steps it redid are charged as such
    assert g["recovery_s"] == pytest.approx(resumed["details"]["seconds_since_failure"], abs=0.01)
    assert g["lost_s"] > 0 and 0 < g["goodput"] < 1
    print(f"\n[local, rank 1 SIGKILLed] resumed {resumed['details']['seconds_since_failure']:.1f} s after the "
          f"failure: {parts}")
