"""summary.json: the run's outcome in one file (run-directory contract), built from the supervisor state and
metrics.jsonl. Written by the supervisor when the run ends, or by the login side when allocations ran out."""

from __future__ import annotations

from typing import Any

from moe_launch.orchestrator.goodput import goodput
from moe_launch.orchestrator.state import SupervisorState
from moe_launch.rundir import RunDir, read_jsonl, write_json_atomic


def build_summary(rd: RunDir, state: SupervisorState, wall_s: float, status: str = "", reason: str = "",
                  resubmits: int = 0) -> dict[str, Any]:
    metrics = [m for m in read_jsonl(rd.metrics) if "step" in m]
    last = metrics[-1] if metrics else {}
    return {
        "status": status or state.status or "failed",
        "reason": reason or state.reason,
        "steps_done": int(last.get("step", 0)),
        "final_loss": last.get("loss"),
        "restarts": state.restarts,
        "resubmits": resubmits,
        "swapped_nodes": [{"out": a, "in": b} for a, b in state.swapped],
        "excluded_nodes": sorted(state.excluded),
        "excluded_reasons": dict(sorted(state.excluded.items())),
        "final_nodes": list(state.active),
        "buffers_left": list(state.buffers),
        "attempts": state.attempt + 1,
        "wall_s": round(wall_s, 3),
        "goodput": goodput(read_jsonl(rd.journal), metrics),  # productive time / wall, and where the rest went
    }


def write_summary(rd: RunDir, summary: dict[str, Any]) -> None:
    write_json_atomic(rd.summary, summary)
