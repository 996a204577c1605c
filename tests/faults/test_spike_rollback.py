"""A loss spike (train.fault_injection.kind=loss_spike on one rank) with train.spike.action=rollback, end to end on the
Slurm cluster: the trainer records the spike and exits for a rollback, the supervisor relaunches on the same nodes,
the trainer restarts from the newest persistent model checkpoint before the spike at that checkpoint's step with a
fresh optimizer, never reads the spike's batch again, and the run completes. The journal tells the whole story."""

from __future__ import annotations

import json

import pytest
from harness import MODEL_CKPT_EVERY, RUN_TIMEOUT_S, STEPS, assert_nothing_lost, finish, overrides, report, start

pytestmark = pytest.mark.slurm
SPIKE_STEP = 10


def test_loss_spike_rolls_back_to_the_model_checkpoint_and_completes(slurm_cluster, tmp_path):
    inject = ["train.fault_injection.kind=loss_spike", "train.fault_injection.rank=1",
              f"train.fault_injection.step={SPIKE_STEP}", "train.spike.action=rollback", "train.spike.window=4",
              "train.spike.threshold=50"]
    proc, rd = start(tmp_path, "spike", *overrides(0, *inject))
    code, summary, records = finish(proc, tmp_path, "spike", RUN_TIMEOUT_S)
    assert code == 0 and summary["status"] == "completed" and summary["restarts"] == 1, summary

    spike = next(r for r in records if r["kind"] == "spike")["details"]
    restart = (SPIKE_STEP - 1) // MODEL_CKPT_EVERY * MODEL_CKPT_EVERY  # 6: the newest model checkpoint before 10
    assert spike["step"] == SPIKE_STEP and spike["action"] == "rollback" and spike["metric"] in ("loss", "grad_norm")
    assert spike["rollback_to"].endswith(f"model-step-{restart}") and spike["skip_batches"] == [9, 9]
    t_spike = next(r for r in records if r["kind"] == "spike")["time"]
    relaunch = next(r for r in records if r["kind"] == "launch" and r["time"] > t_spike)
    assert "spike" in relaunch["details"]["reason"] and "same nodes" in relaunch["details"]["reason"]
    after = [r["details"] for r in records if r["kind"] == "resume" and r["time"] > t_spike]
    # the trainer's own record (the supervisor's carries the recovery times)
    resume = next((d for d in after if d.get("model_only")), after)
    assert isinstance(resume, dict), resume
    assert resume["rollback"] and resume["fresh_optimizer"] and resume["step"] == restart
    assert not summary.get("excluded_nodes")  # a spike blames no node
    state = json.loads((rd / "rollback.json").read_text())
    assert state["skips"] == [[9, 9]] and state["spikes"] == [SPIKE_STEP]
    done = [r for r in records if r["kind"] == "checkpoint" and r["details"].get("step") == STEPS]
    assert done, "the rolled-back run reached the last step"
    assert_nothing_lost(rd, records)
    report("spike rollback", t_spike, records)
