"""Goodput over a journal and metrics of a run with preflight, a checkpoint, a failure, a recovery and lost steps."""

from __future__ import annotations

import pytest

from moe_launch.orchestrator.goodput import KINDS, goodput, lost_rows, timeline


def _rec(t, kind, **details):
    return {"time": t, "kind": kind, "nodes": [], "details": details}


def _row(t, step, step_time_s=1.0):
    return {"time": t, "step": step, "step_time_s": step_time_s, "loss": 1.0}


# allocation at 0, preflight until the launch at 10, steps of 1 s from 11; a checkpoint after step 3 stalls 0.5 s
# (inside step 4's interval); the rank dies after step 5 (last heartbeat 16.5); the relaunch trains again 4.5 s
# later from the step-3 checkpoint, so steps 4 and 5 are lost; the final checkpoint after step 6 stalls 0.6 s.
JOURNAL = [
    _rec(0.0, "allocation"), _rec(0.1, "preflight"),
    _rec(10.0, "launch", action={"kind": "launch"}),
    _rec(14.5, "checkpoint", slot="ckpt-a", step=3, stall_s=0.5),
    _rec(17.0, "failure", event="StepExited"),
    _rec(17.0, "launch", action={"kind": "relaunch"}),
    _rec(19.0, "resume", checkpoint="ckpt-a", step=3),
    _rec(21.0, "resume", step=4, seconds_since_failure=4.5, breakdown={}),
    _rec(24.6, "checkpoint", slot="ckpt-b", step=6, stall_s=0.6),
    _rec(25.0, "done"),
]
METRICS = [_row(12.0, 1), _row(13.0, 2), _row(14.0, 3), _row(15.5, 4, 1.5), _row(16.5, 5),
           _row(22.0, 4), _row(23.0, 5), _row(24.0, 6)]


def test_each_kind_is_charged_once_and_the_parts_fill_the_wall_time():
    got = goodput(JOURNAL, METRICS)
    assert got["wall_s"] == 25.0
    assert got["preflight_s"] == 10.0 and got["startup_s"] == 1.0 and got["recovery_s"] == 4.5
    assert got["checkpoint_s"] == pytest.approx(1.1)
    assert got["lost_s"] == pytest.approx(2.0)  # steps 4 (1.5 s, of which 0.5 s checkpoint) and 5
    assert got["productive_s"] == pytest.approx(5.0)  # steps 1-3, 5 and 6; the first resumed step is recovery's
    assert sum(got[f"{k}_s"] for k in KINDS) == pytest.approx(25.0)
    assert got["goodput"] == pytest.approx(0.2)


def test_lost_steps_are_the_earlier_runs_of_repeated_steps():
    assert [(m["step"], m["time"]) for m in lost_rows(METRICS)] == [(4, 15.5), (5, 16.5)]


def test_timeline_orders_the_non_productive_segments():
    kinds = [s.kind for s in timeline(JOURNAL, METRICS)]
    assert kinds == ["preflight", "startup", "checkpoint", "lost", "lost", "recovery", "checkpoint"]


def test_sparse_logging_scales_the_logged_steps():
    every_other = [m for m in METRICS if m["step"] % 2 == 0]  # train.log_interval=2: steps 2, 4, 4, 6 logged
    sparse = goodput(JOURNAL, every_other)
    assert sparse == goodput(JOURNAL, every_other, log_interval=2)  # the interval is read off the logged steps
    assert sparse["productive_s"] == pytest.approx(2 * goodput(JOURNAL, every_other, log_interval=1)["productive_s"])


def test_empty_run():
    assert goodput([], []) == {"wall_s": 0.0, "goodput": 0.0}
