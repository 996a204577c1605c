"""summary.json's checkpoint_step: the newest complete full checkpoint (where a resume starts), which after a failed
write can be well behind steps_done."""

from __future__ import annotations

import json

from moe_launch.orchestrator.summary import newest_checkpoint_step


def _slot(rd, name: str, step: int, files: dict[str, bytes], listed: dict[str, int] | None = None) -> None:
    d = rd.checkpoints / name
    d.mkdir(parents=True)
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    sizes = listed if listed is not None else {rel: len(data) for rel, data in files.items()}
    (d / "manifest.json").write_text(json.dumps({"step": step, "files": {r: {"bytes": n} for r, n in sizes.items()}}))


def test_checkpoint_step_is_the_newest_complete_slot(tmp_run_dir):
    assert newest_checkpoint_step(tmp_run_dir) is None
    _slot(tmp_run_dir, "ckpt-a", 3, {"model/dense.pt": b"x" * 10})
    _slot(tmp_run_dir, "ckpt-b", 6, {"model/dense.pt": b"x" * 4}, listed={"model/dense.pt": 10})  # cut short
    assert newest_checkpoint_step(tmp_run_dir) == 3
    (tmp_run_dir.checkpoints / "ckpt-b" / "model" / "dense.pt").write_bytes(b"y" * 10)
    assert newest_checkpoint_step(tmp_run_dir) == 6
    (tmp_run_dir.checkpoints / "ckpt-b" / "manifest.json").write_text("{torn")
    assert newest_checkpoint_step(tmp_run_dir) == 3
