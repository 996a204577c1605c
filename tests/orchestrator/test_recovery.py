"""The recovery breakdown: phases add up to seconds_since_failure, clock skew never makes a phase negative, and the
trainer's start record is read for its own attempt only."""

from __future__ import annotations

import time

import pytest
import torch

from moe_launch.orchestrator.recovery import PHASES, breakdown, resume_details
from moe_launch.rundir import RunDir
from moe_launch.trainer.start_phases import COMPILE_TIMER, StartPhases, read_start_record


def test_phases_in_order_and_sum_to_the_recovery():
    start = {"process_start": 103.0, "restore_start": 106.5, "restore_end": 108.0, "compile_s": 1.5}
    got = breakdown(failed_at=100.0, detected_at=101.0, resumed_at=110.0, start=start)
    assert list(got) == list(PHASES)
    assert got == {"detect": 1.0, "relaunch": 2.0, "process_start": 3.5, "restore": 1.5, "compile": 1.5,
                   "first_step": 0.5}


def test_skewed_or_missing_times_are_clamped_not_negative():
    # the trainer's clock runs 5 s behind: its process "started" before the supervisor decided to relaunch
    start = {"process_start": 96.0, "restore_start": 99.0, "restore_end": 120.0, "compile_s": 30.0}
    got = breakdown(100.0, 101.0, 110.0, start)
    assert all(v >= 0 for v in got.values()), got
    assert sum(got.values()) == pytest.approx(10.0)
    assert got["relaunch"] == 0.0 and got["compile"] == 0.0  # restore_end clamped to the end leaves no room
    partial = breakdown(100.0, 101.0, 110.0, {"process_start": 104.0})  # an older trainer's partial record
    assert sum(partial.values()) == pytest.approx(10.0) and partial["first_step"] == 6.0


def test_without_a_start_record_the_restart_is_one_phase(tmp_path):
    rd = RunDir(tmp_path).make()
    got = resume_details(rd.heartbeat, attempt=1, failed_at=None, detected_at=50.0, resumed_at=62.5)
    assert got == {"seconds_since_failure": 12.5, "breakdown": {"detect": 0.0, "relaunch": 12.5}}


def test_start_record_of_this_attempt_only(tmp_path):
    rd = RunDir(tmp_path).make()
    phases = StartPhases(attempt=2, compiled=False)
    phases.mark("restore_start")
    phases.mark("restore_end")
    phases.first_backward_done(rd, write=True)
    assert not phases.pending
    rec = read_start_record(rd.heartbeat, 2)
    assert rec is not None and rec["process_start"] <= rec["restore_start"] <= rec["restore_end"] <= time.time()
    assert read_start_record(rd.heartbeat, 3) is None  # a relaunch must not use the previous attempt's times
    got = resume_details(rd.heartbeat, 2, failed_at=rec["process_start"] - 2.0, detected_at=rec["process_start"] - 1.0,
                         resumed_at=rec["restore_end"] + 0.5)
    assert list(got["breakdown"]) == list(PHASES)
    assert sum(got["breakdown"].values()) == pytest.approx(got["seconds_since_failure"], abs=0.01)


def test_compile_timer_counts_dynamo_compiles():
    StartPhases(attempt=0, compiled=True)  # registers the Dynamo callbacks
    before = COMPILE_TIMER.seconds

    @torch.compile(backend="eager", dynamic=False)
    def f(x):
        return torch.sin(x) * 2 + 1

    f(torch.ones(7))
    assert COMPILE_TIMER.seconds > before
    after_first = COMPILE_TIMER.seconds
    f(torch.ones(7))  # cached: no compile
    assert COMPILE_TIMER.seconds == after_first
