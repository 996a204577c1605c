"""The supervisor loop on cluster.kind=local with a contract-following stand-in trainer (tests/orchestrator/
fake_trainer.py): watcher, step attribution, journal and summary. End-to-end tests with the real trainer live in
test_e2e_local.py and test_e2e_slurm.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moe_launch.conf.load import dump_config
from moe_launch.conf.schema import (
    ClusterConfig,
    FaultInjection,
    HealthConfig,
    ParallelConfig,
    RootConfig,
    RunConfig,
    SupervisorConfig,
    TrainConfig,
)
from moe_launch.orchestrator.plan import plan, write_plan
from moe_launch.orchestrator.state import replay
from moe_launch.orchestrator.supervisor import STOP_FILE, Supervisor
from moe_launch.rundir import RunDir, read_jsonl

FAKE = str(Path(__file__).parent / "fake_trainer.py")


def make_cfg(tmp_path, nodes=2, buffers=1, fault=None, steps=12, **sup) -> tuple[RootConfig, RunDir]:
    cfg = RootConfig(
        cluster=ClusterConfig(kind="local", nodes=nodes, buffers=buffers),
        parallel=ParallelConfig(dp=nodes),
        train=TrainConfig(steps=steps, step_sleep_s=0.05, ckpt_interval=4, global_batch_size=4 * nodes,
                          fault_injection=fault or FaultInjection()),
        health=HealthConfig(preflight=False),
        supervisor=SupervisorConfig(**{"poll_s": 0.05, "hang_timeout_s": 15.0,
                                       "trainer_command": [sys.executable, FAKE], **sup}),
        run=RunConfig(name="t", root=str(tmp_path)),
    )
    rd = RunDir(tmp_path / "t").make()
    dump_config(cfg, rd.config)
    write_plan(plan(cfg, run_dir=str(rd.root)), rd.root)  # what moe-launch writes before starting a supervisor
    return cfg, rd


def run(cfg, rd):
    code = Supervisor(cfg, rd).run()
    return code, json.loads(rd.summary.read_text()), read_jsonl(rd.journal)


def kinds(journal):
    return [r["kind"] for r in journal]


def test_clean_run_completes(tmp_path):
    code, summary, journal = run(*make_cfg(tmp_path))
    assert code == 0 and summary["status"] == "completed" and summary["steps_done"] == 12
    assert summary["restarts"] == 0 and summary["excluded_nodes"] == []
    assert summary["final_nodes"] == ["local1", "local2"]
    assert kinds(journal)[:1] == ["allocation"] and "launch" in kinds(journal) and kinds(journal)[-1] == "done"


def test_killed_node_is_excluded_and_buffer_swapped_in(tmp_path):
    cfg, rd = make_cfg(tmp_path, fault=FaultInjection(kind="sigkill", rank=1, step=6))
    code, summary, journal = run(cfg, rd)
    assert code == 0 and summary["status"] == "completed" and summary["steps_done"] == 12
    assert summary["excluded_nodes"] == ["local2"] and summary["swapped_nodes"] == [{"out": "local2", "in": "local3"}]
    assert summary["restarts"] == 1 and summary["final_nodes"] == ["local1", "local3"]
    ks = kinds(journal)
    assert ks.index("failure") < ks.index("exclude") < ks.index("swap") < ks.index("resume")
    resume = next(r for r in journal if r["kind"] == "resume")
    assert resume["details"]["step"] == 5  # the fake resumes from its step-4 checkpoint
    # the journal alone rebuilds the supervisor's final state
    state = replay(journal, 2, cfg.supervisor.max_restarts)
    assert state.excluded.keys() == {"local2"} and state.active == ("local1", "local3") and state.status == "completed"


def test_nan_sets_node_aside_and_without_preflight_it_stays_out(tmp_path):
    cfg, rd = make_cfg(tmp_path, fault=FaultInjection(kind="nan", rank=0, step=3))
    code, summary, journal = run(cfg, rd)
    assert code == 0 and summary["status"] == "completed"
    assert summary["swapped_nodes"] == [{"out": "local1", "in": "local3"}]
    assert "local1" in summary["excluded_nodes"] and "re-check" in summary["excluded_reasons"]["local1"]
    fault = next(r for r in journal if r["kind"] == "fault")
    assert fault["nodes"] == ["local1"] and fault["details"]["step"] == 3


def test_deterministic_nan_stops_with_diagnosis(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRAINER_ALWAYS_INJECT", "1")
    cfg, rd = make_cfg(tmp_path, buffers=2, fault=FaultInjection(kind="nan", rank=0, step=6))
    code, summary, journal = run(cfg, rd)
    assert code == 1 and summary["status"] == "failed"
    assert "deterministic model fault" in summary["reason"] and "step 6" in summary["reason"]
    assert summary["restarts"] == 1


def test_hang_detected_and_stalled_node_replaced(tmp_path):
    cfg, rd = make_cfg(tmp_path, fault=FaultInjection(kind="hang", rank=1, step=5), steps=8, hang_timeout_s=3.0)
    code, summary, journal = run(cfg, rd)
    assert code == 0 and summary["status"] == "completed"
    hang = next(r for r in journal if r["details"].get("event") == "Hang")
    assert hang["nodes"] == ["local2"]
    assert summary["swapped_nodes"] == [{"out": "local2", "in": "local3"}]


def test_buffers_exhausted_stops_cleanly(tmp_path):
    cfg, rd = make_cfg(tmp_path, buffers=0, fault=FaultInjection(kind="sigkill", rank=0, step=3))
    code, summary, _ = run(cfg, rd)
    assert code == 1 and summary["status"] == "failed" and "buffers exhausted" in summary["reason"]
    assert summary["excluded_nodes"] == ["local1"] and summary["steps_done"] >= 2


def test_stop_file_stops_the_run(tmp_path):
    cfg, rd = make_cfg(tmp_path, steps=10_000)
    (rd.root / STOP_FILE).write_text("")
    code, summary, _ = run(cfg, rd)
    assert code == 1 and summary["status"] == "stopped"


@pytest.mark.parametrize("crash_twice", [True, False])
def test_crash_without_node_cause_retried_then_stops_if_repeating(tmp_path, monkeypatch, crash_twice):
    if crash_twice:
        monkeypatch.setenv("FAKE_TRAINER_ALWAYS_INJECT", "1")
    cfg, rd = make_cfg(tmp_path, fault=FaultInjection(kind="crash", rank=1, step=6))
    code, summary, _ = run(cfg, rd)
    if crash_twice:
        assert summary["status"] == "failed" and "same failure repeating" in summary["reason"]
    else:
        assert summary["status"] == "completed" and summary["restarts"] == 1 and summary["excluded_nodes"] == []


def test_every_event_kind_can_be_journaled(tmp_run_dir):
    from moe_launch.orchestrator.events import (
        Fault,
        Hang,
        LaunchTimeout,
        NodesLost,
        PreflightDone,
        StepExited,
        StopRequested,
        SuspectChecked,
    )
    from moe_launch.orchestrator.supervisor import event_record
    from moe_launch.rundir import journal_event

    events = [PreflightDone(("a", "b"), {"c": "x"}), StepExited(0, 1, ("a",), ("b",), 3, "d"),
              Fault(0, "a", 1, 2, "nan"), Hang(0, ("a",), 3, 9.0), NodesLost(("a", "b"), "down*"),
              SuspectChecked("a", True), LaunchTimeout(0), StopRequested()]
    for ev in events:
        kind, nodes, details = event_record(ev)
        journal_event(tmp_run_dir, kind, nodes, **details)
    journal = read_jsonl(tmp_run_dir.journal)
    assert [r["details"]["event"] for r in journal] == [type(e).__name__ for e in events]
    assert journal[4]["nodes"] == ["a", "b"] and journal[4]["kind"] == "failure"
