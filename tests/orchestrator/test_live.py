"""The login side's view, rebuilt from a run directory's files alone (what `attach` and `status` show)."""

from __future__ import annotations

from rich.console import Console

from moe_launch.orchestrator.decide import decide
from moe_launch.orchestrator.events import PreflightDone, StepExited
from moe_launch.orchestrator.live import describe, eta_seconds, render, snapshot
from moe_launch.orchestrator.state import apply, initial_state
from moe_launch.rundir import append_jsonl, journal_event, write_json_atomic


def test_eta_uses_recent_steps_of_the_current_attempt():
    metrics = [{"step": s, "time": 100.0 + 2 * s} for s in range(1, 11)]
    assert eta_seconds(metrics, 20) == 20.0  # 10 steps left at 2 s each
    resumed = metrics + [{"step": s, "time": 200.0 + 4 * s} for s in range(8, 12)]  # resumed at step 8, slower
    assert eta_seconds(resumed, 20) == 36.0
    assert eta_seconds(metrics[:1], 20) is None


def test_snapshot_and_render_from_files(tmp_run_dir):
    rd = tmp_run_dir
    nodes = ["n1", "n2", "n3"]
    journal_event(rd, "allocation", nodes, job_id="5")
    s = initial_state(2, 5, nodes)
    for ev in (PreflightDone(healthy=tuple(nodes)), StepExited(attempt=0, code=1, dead_nodes=("n2",), detail="x")):
        a = decide(s, ev)
        s = apply(s, a)
        journal_event(rd, "launch", a.nodes or (), action=a.to_json(), reason=a.reason)
    for step in range(1, 6):
        append_jsonl(rd.metrics, {"step": step, "loss": 5.0 / step, "tokens_per_s": 1234.0, "time": 10.0 + step})
    write_json_atomic(rd.heartbeat / "rank0.json", {"step": 5, "time": 1.0, "host": "n1", "pid": 1})
    snap = snapshot(rd, 2, 5, total_steps=10)
    assert snap.state == s and snap.state.active == ("n1", "n3") and snap.node_steps == {"n1": 5}
    assert snap.eta_s == 5.0 and snap.summary is None
    console = Console(width=150, record=True)
    console.print(render(snap))
    text = console.export_text()
    for expected in ("step 5/10", "loss 1.0000", "restarts 1", "n2", "excluded", "node failure"):
        assert expected in text, expected
    assert "launch" in describe(snap.journal[-1])
