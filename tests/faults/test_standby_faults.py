"""A node's trainer processes killed, with warm standbys on every node (supervisor.standby=all): both ranks of the
relaunch are handed to standby processes (separate srun steps, started after the first launch), the resume reads
the checkpoint they hold in memory, and the run still ends bitwise equal to the uninterrupted reference."""

from __future__ import annotations

import json

import pytest
from e2e_util import kill_ranks_on, wait_for
from harness import (
    RUN_TIMEOUT_S,
    SLOW,
    assert_story,
    check_outcome,
    finish,
    newest_ckpt_before,
    overrides,
    report,
    resumed_after,
    start,
    wait_launch,
    wait_step,
)

pytestmark = pytest.mark.slurm


def _held(rd, node: str):
    """The checkpoint step a ready standby of `node` holds, or None."""
    try:
        rec = json.loads((rd / "standby" / f"{node}-l0.json").read_text())
    except (OSError, ValueError):
        return None
    return rec.get("held_step") if rec.get("state") == "ready" else None


def test_fault01_with_standbys_every_rank_resumes_warm_from_memory(reference, tmp_path):
    proc, rd = start(tmp_path, "f01s", *overrides(1, SLOW, "supervisor.standby=all"))
    launch = wait_launch(rd)
    (survivor, victim), spare = launch["details"]["action"]["nodes"], launch["details"]["action"]["buffers"][0]
    for node in (survivor, spare):
        wait_for(lambda n=node: _held(rd, n), RUN_TIMEOUT_S, f"{node}'s standby holding a checkpoint")
    wait_step(rd, 4)
    held = _held(rd, spare)
    t_fault = kill_ranks_on(rd, victim)
    code, summary, records = finish(proc, tmp_path, "f01s", RUN_TIMEOUT_S)
    assert code == 0, summary
    failure = assert_story(records, victim, ("StepExited", "node failure"), "swap")
    _, trainer = resumed_after(records, failure["time"])
    assert trainer["details"]["step"] == newest_ckpt_before(records, trainer["time"])
    # from memory unless a newer checkpoint became durable between the standby's last look and the kill
    assert trainer["details"]["from_memory"] == (trainer["details"]["step"] == held)
    for node in (survivor, spare):
        logs = "".join(p.read_text() for p in (rd / "logs" / "attempt1").rglob("*.log"))
        assert f"handed to the warm standby {node}-l0" in logs, logs[-3000:]
    check_outcome(rd, records, summary, reference, restarts=1, swapped=[(victim, spare)])
    report("01 node processes killed, standby=all", t_fault, records)
