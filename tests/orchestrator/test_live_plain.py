"""The login side's plain view (no terminal: `moe-launch ... | tee`, CI): journal events and step lines by time."""

from __future__ import annotations

import io

from rich.console import Console

from moe_launch.orchestrator.live import LiveView, plain_lines
from moe_launch.rundir import RunDir, append_jsonl


def test_plain_lines_merge_events_and_steps_by_time():
    journal = [{"time": 10.0, "kind": "launch", "nodes": ["n1"], "details": {}},
               {"time": 30.0, "kind": "checkpoint", "nodes": [], "details": {"slot": "ckpt-a", "step": 2}}]
    metrics = [{"step": 1, "time": 20.0, "loss": 5.0}, {"step": 2, "time": 29.0, "loss": 4.5}]
    lines = plain_lines(journal, metrics, total_steps=4)
    assert [ln.split()[1] for ln in lines] == ["launch", "step", "step", "checkpoint"]
    assert "step 2/4 | loss 4.5000" in lines[2]


def test_live_view_prints_each_new_step_once(tmp_path):
    rd = RunDir(tmp_path).make()
    out = io.StringIO()
    view = LiveView(rd, want=1, max_restarts=0, total_steps=3, console=Console(file=out, width=200))
    append_jsonl(rd.metrics, {"step": 1, "time": 1.0, "loss": 3.0})
    view.update()
    append_jsonl(rd.metrics, {"step": 2, "time": 2.0, "loss": 2.5})
    view.update()
    view.update()
    view.close()
    text = out.getvalue()
    assert text.count("step 1/3") == 1 and text.count("step 2/3") == 1
