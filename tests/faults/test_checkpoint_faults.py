"""Faults 6 and 7: a rank killed while a checkpoint is being written, and the newest checkpoint corrupted on disk.
Either way the older checkpoint must be used and the run must end bitwise equal to the reference."""

from __future__ import annotations

import pytest
from harness import (
    RUN_TIMEOUT_S,
    SLOW,
    check_outcome,
    finish,
    journal,
    overrides,
    report,
    resumed_after,
    start,
    wait_checkpoint,
    wait_launch,
)

pytestmark = pytest.mark.slurm


def test_fault06_kill_during_checkpoint_write(reference, tmp_path):
    """Rank 1 SIGKILLs itself inside the step-6 checkpoint, after its shards are on disk, before the manifest."""
    inject = ["train.fault_injection.kind=kill_during_ckpt", "train.fault_injection.rank=1",
              "train.fault_injection.step=6"]
    proc, rd = start(tmp_path, "f06", *overrides(1, *inject))
    code, summary, records = finish(proc, tmp_path, "f06", RUN_TIMEOUT_S)
    assert code == 0, summary
    failure = next(r for r in records if r["kind"] == "failure")
    launch = next(r for r in records if r["kind"] == "launch")
    victim, spare = launch["details"]["action"]["nodes"][1], launch["details"]["action"]["buffers"][0]
    assert victim in failure["nodes"], failure
    before = [r["details"]["step"] for r in records if r["kind"] == "checkpoint" and r["time"] < failure["time"]
              and not r["details"].get("model_only")]
    assert before == [3], before  # the half-written step-6 checkpoint was never completed
    _, trainer = resumed_after(records, failure["time"])
    assert trainer["details"]["step"] == 3, trainer  # the older checkpoint, not the half-written one
    swap = next(r for r in records if r["kind"] == "swap" and r["time"] >= failure["time"])
    assert swap["details"] == {"out": victim, "buffer_in": spare}
    check_outcome(rd, records, summary, reference, restarts=1, swapped=[(victim, spare)])
    report("06 kill during checkpoint", failure["time"], records)


def test_fault07_corrupted_newest_checkpoint(reference, tmp_path):
    """The step-6 checkpoint is corrupted (bytes flipped) as soon as it is written; rank 1 then dies at step 8, and
    the resume must detect the corruption by checksum and fall back to step 3."""
    inject = ["train.fault_injection.kind=sigkill", "train.fault_injection.rank=1", "train.fault_injection.step=8",
              SLOW]  # timing only: leaves room to corrupt step 6 before the kill at step 8
    proc, rd = start(tmp_path, "f07", *overrides(1, *inject))
    launch = wait_launch(rd)
    victim, spare = launch["details"]["action"]["nodes"][1], launch["details"]["action"]["buffers"][0]
    ckpt6 = wait_checkpoint(rd, 6)
    target = rd / "checkpoints" / ckpt6["details"]["slot"] / "model" / "dense.pt"
    data = bytearray(target.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):  # same size: only the checksum can tell
        data[i] ^= 0xFF
    target.write_bytes(bytes(data))
    assert not [r for r in journal(rd) if r["kind"] == "failure"], "the kill came before the corruption"
    code, summary, records = finish(proc, tmp_path, "f07", RUN_TIMEOUT_S)
    assert code == 0, summary
    failure = next(r for r in records if r["kind"] == "failure")
    assert victim in failure["nodes"], failure
    _, trainer = resumed_after(records, failure["time"])
    assert trainer["details"]["step"] == 3 and trainer["details"]["fell_back"], trainer
    assert "mismatch (corrupted)" in trainer["details"]["rejected"][ckpt6["details"]["slot"]]
    check_outcome(rd, records, summary, reference, restarts=1, swapped=[(victim, spare)])
    report("07 corrupted newest checkpoint", failure["time"], records)
