"""Faults 3, 4, 5: NaN loss on one rank, Inf in one gradient on one rank, one rank hanging. The trainer's own fault
injection (train.fault_injection, first attempt only) produces them; the run must end bitwise equal to the reference."""

from __future__ import annotations

import pytest
from harness import (
    RUN_TIMEOUT_S,
    assert_story,
    check_outcome,
    finish,
    newest_ckpt_before,
    overrides,
    report,
    resumed_after,
    start,
)

pytestmark = pytest.mark.slurm
FAULT_STEP = 5


def _soft_fault(reference, tmp_path, name: str, kind: str, what: str):
    inject = [f"train.fault_injection.kind={kind}", "train.fault_injection.rank=1",
              f"train.fault_injection.step={FAULT_STEP}"]
    proc, rd = start(tmp_path, name, *overrides(1, *inject))
    code, summary, records = finish(proc, tmp_path, name, RUN_TIMEOUT_S)
    assert code == 0, summary
    launch = next(r for r in records if r["kind"] == "launch")
    victim, spare = launch["details"]["action"]["nodes"][1], launch["details"]["action"]["buffers"][0]  # rank 1
    fault = assert_story(records, victim, what, "swap")
    assert fault["details"]["step"] == FAULT_STEP and fault["details"]["rank"] == 1
    _, trainer = resumed_after(records, fault["time"])
    assert trainer["details"]["step"] == newest_ckpt_before(records, trainer["time"]) == 3
    # health.preflight=false: the suspect cannot be cleared by a re-check, so it stays out of the run
    assert victim in summary["excluded_nodes"] and victim not in summary["final_nodes"]
    check_outcome(rd, records, summary, reference, restarts=1, swapped=[(victim, spare)])
    report(f"{name} {kind}", fault["time"], records)


def test_fault03_nan_loss_on_one_rank(reference, tmp_path):
    _soft_fault(reference, tmp_path, "f03", "nan", "non-finite loss")


def test_fault04_inf_gradient_on_one_rank(reference, tmp_path):
    _soft_fault(reference, tmp_path, "f04", "inf_grad", "non-finite local gradient")


def test_fault05_hang_on_one_rank(reference, tmp_path):
    """Rank 1 sleeps at the start of step 5, so rank 0 blocks in the step's collective: both heartbeats stop at the
    same step and no single node can be blamed; the supervisor relaunches on the same nodes after the hang timeout."""
    inject = ["train.fault_injection.kind=hang", "train.fault_injection.rank=1",
              f"train.fault_injection.step={FAULT_STEP}", "supervisor.hang_timeout_s=15"]
    proc, rd = start(tmp_path, "f05", *overrides(1, *inject))
    code, summary, records = finish(proc, tmp_path, "f05", RUN_TIMEOUT_S)
    assert code == 0, summary
    hang = next(r for r in records if r["kind"] == "failure" and r["details"].get("event") == "Hang")
    assert hang["details"]["idle_s"] >= 15
    relaunch = next(r for r in records if r["kind"] == "launch" and r["time"] >= hang["time"])
    assert "hang" in relaunch["details"]["reason"] and "same nodes" in relaunch["details"]["reason"]
    first = next(r for r in records if r["kind"] == "launch")
    assert relaunch["nodes"] == first["nodes"]  # nobody to blame: the same nodes
    _, trainer = resumed_after(records, hang["time"])
    assert trainer["details"]["step"] == newest_ckpt_before(records, trainer["time"])
    check_outcome(rd, records, summary, reference, restarts=1, swapped=[])
    # the time to resume counts from the last heartbeat: the hang timeout is part of it
    report("05 hang", hang["time"] - hang["details"]["idle_s"], records)
