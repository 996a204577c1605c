"""summary.json: the run's outcome in one file (run-directory contract), built from the supervisor state and
metrics.jsonl. Written by the supervisor when the run ends, or by the login side when allocations ran out."""

from __future__ import annotations

import json
from typing import Any, Optional

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
        # where a resume starts: steps after it are lost (steps_done can be ahead of it after a failed write)
        "checkpoint_step": newest_checkpoint_step(rd),
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


def newest_checkpoint_step(rd: RunDir) -> Optional[int]:
    """Step of the newest full checkpoint slot that is complete: its manifest (written last) parses and every file it
    lists is there at its size. Digests are left to the trainer's resume, which reads the files anyway; None when no
    slot is complete. Reads trainer/checkpoint/store.py's layout without importing torch."""
    best: Optional[int] = None
    for slot in ("ckpt-a", "ckpt-b"):
        d = rd.checkpoints / slot
        try:
            manifest = json.loads((d / "manifest.json").read_text())
            complete = all((d / rel).stat().st_size == int(info["bytes"]) for rel, info in manifest["files"].items())
            step = int(manifest["step"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if complete and (best is None or step > best):
            best = step
    return best


def write_summary(rd: RunDir, summary: dict[str, Any]) -> None:
    write_json_atomic(rd.summary, summary)
