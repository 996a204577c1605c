"""Real Slurm time limits (cluster.time_limit_min=1). A run longer than one window is a chain of allocations: each ends
with the trainer's checkpoint on the USR2 that `--signal=B:USR2@N` sends the supervisor before the limit (passed on
to the trainer once it runs), and the login side submits the next one. Such continuations must not use up
supervisor.max_resubmits (default 2) and must not show as FAILED in sacct. Without the warning the limit's
SIGTERM/SIGKILL ends the step, and the next allocation resumes from the newest valid checkpoint. Both runs end bitwise
equal to the uninterrupted reference.

Slurm sends the warning up to a minute early, on its own 30 s tick: in a one-minute window it lands anywhere from the
start to 30 s before the end. The step times below are chosen so that the asserted allocation counts hold either
way."""

from __future__ import annotations

import pytest
from harness import STEPS, check_outcome, finish, newest_ckpt_before, overrides, resumed_after, start
from slurm.helpers import wait_sacct_state

pytestmark = pytest.mark.slurm
# the warning lands at most 30 s into a 60-90 s window and is passed on after the trainer's first step: at most
# 30 s + 2 steps of work per window. With 17 s steps that is at most 3 of the 12 steps per window: >= 4 windows.
CHAIN = ["cluster.time_limit_min=1", "cluster.signal_before_end_s=30", "train.step_sleep_s=17"]
# no warning: the limit's SIGTERM reaches the trainer mid-step, and a 10 s step rarely ends within the test cluster's
# KillWait (5 s) before SIGKILL; either way the supervisor (SIGTERMed too) records no clean end
LATE = ["cluster.time_limit_min=1", "cluster.signal_before_end_s=0", "train.step_sleep_s=10"]


def test_time_limit_chain_of_four_or_more_allocations_completes_with_default_resubmits(reference, tmp_path):
    proc, rd = start(tmp_path, "tl4", *overrides(0, *CHAIN))
    code, summary, records = finish(proc, tmp_path, "tl4", 1200)
    assert code == 0, summary
    allocs = [r for r in records if r["kind"] == "allocation"]
    resubmits = [r for r in records if r["kind"] == "resubmit"]
    ran = {r["details"]["job_id"] for r in allocs}
    after_ran = [r for r in resubmits if r["details"]["previous_job"] in ran]
    assert len(allocs) >= 4 and len(after_ran) == len(allocs) - 1, [r["kind"] for r in records]
    assert all(r["details"]["continuation"] for r in after_ran), [r["details"] for r in after_ran]
    # a job that ended before its supervisor started (a launch failure of the shared test cluster) is resubmitted
    # too, journaled with its Slurm state, and is no continuation
    for r in resubmits:
        if r["details"]["previous_job"] not in ran:
            assert r["details"]["never_started"] and not r["details"]["continuation"], r["details"]
            assert any(e["details"].get("never_started") and e["details"]["job"] == r["details"]["previous_job"]
                       for e in records if e["kind"] == "info"), r["details"]
    # every window ended in a signal checkpoint, and the next one resumed exactly there
    for resub in resubmits:
        _, trainer = resumed_after(records, resub["time"])
        assert trainer["details"]["step"] == newest_ckpt_before(records, trainer["time"])
    # the continuation allocations are no failures in Slurm's accounting either
    for r in allocs[:-1]:
        assert wait_sacct_state(r["details"]["job_id"], {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"}) == \
            "COMPLETED", r["details"]["job_id"]
    assert summary["resubmits"] == len(resubmits)
    check_outcome(rd, records, summary, reference, restarts=0, swapped=[])
    print(f"\n[time limit] {STEPS} steps over {len(allocs)} one-minute allocations, all continuations")


def test_no_warning_signal_resumes_from_the_newest_valid_checkpoint(reference, tmp_path):
    proc, rd = start(tmp_path, "tlate", *overrides(0, *LATE))
    code, summary, records = finish(proc, tmp_path, "tlate", 900)
    assert code == 0, summary
    resubmits = [r for r in records if r["kind"] == "resubmit"]
    assert resubmits, [r["kind"] for r in records]
    first = resubmits[0]
    signalled = any(r["kind"] == "stop" and r["details"].get("reason") == "signal" and r["time"] <= first["time"]
                    for r in records)
    # the supervisor never saw a clean end: the allocation was lost, not continued (it counts against max_resubmits)
    assert first["details"]["continuation"] is False
    assert wait_sacct_state(first["details"]["previous_job"], {"TIMEOUT", "FAILED", "CANCELLED", "COMPLETED"}) == \
        "TIMEOUT"
    _, trainer = resumed_after(records, first["time"])
    assert trainer["details"]["step"] == newest_ckpt_before(records, trainer["time"])
    check_outcome(rd, records, summary, reference, restarts=0, swapped=[])
    print(f"\n[time limit, late signal] resumed from step {trainer['details']['step']} "
          f"({'signal checkpoint' if signalled else 'no signal checkpoint'})")
