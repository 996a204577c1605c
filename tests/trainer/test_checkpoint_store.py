"""Atomic checkpoint directories: manifest last, verification, slot choice, a kill mid-write loses nothing."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_launch.trainer.checkpoint.store import (
    MANIFEST,
    choose_resume_slot,
    load_file,
    next_slot,
    read_manifest,
    verify,
    write_checkpoint,
)
from moe_launch.trainer.dist import Comm

REPO = Path(__file__).resolve().parents[2]


def _write(root: Path, slot: str, step: int) -> Path:
    files = {"model/dense.pt": {"w": torch.full((4,), float(step))}, "rng/rank0.pt": {"torch": torch.get_rng_state()}}
    return write_checkpoint(root / slot, step, files, Comm(), meta={"note": "test"})


def test_write_verify_load_roundtrip(tmp_path):
    d = _write(tmp_path, "ckpt-a", 3)
    m = read_manifest(d)
    assert m["step"] == 3 and set(m["files"]) == {"model/dense.pt", "rng/rank0.pt"} and m["meta"] == {"note": "test"}
    assert verify(d) == (True, "ok")
    assert torch.equal(load_file(d, "model/dense.pt")["w"], torch.full((4,), 3.0))
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "temp dirs must be renamed or removed"


def test_newest_valid_slot_and_alternation(tmp_path):
    assert choose_resume_slot(tmp_path).path is None
    assert next_slot(None) == "ckpt-a"
    _write(tmp_path, "ckpt-a", 2)
    _write(tmp_path, next_slot("ckpt-a"), 4)
    c = choose_resume_slot(tmp_path)
    assert (c.path.name, c.step, c.fell_back) == ("ckpt-b", 4, False)
    assert next_slot("ckpt-b") == "ckpt-a"
    _write(tmp_path, "ckpt-a", 6)  # overwrite the older slot
    assert choose_resume_slot(tmp_path).step == 6


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_file", "delete_manifest", "garbage_manifest"])
def test_damaged_newest_falls_back_to_older(tmp_path, damage):
    _write(tmp_path, "ckpt-a", 2)
    newest = _write(tmp_path, "ckpt-b", 4)
    target = newest / "model/dense.pt"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete_file":
        target.unlink()
    elif damage == "delete_manifest":
        (newest / MANIFEST).unlink()
    else:
        (newest / MANIFEST).write_text("{not json")
    ok, reason = verify(newest)
    assert not ok and reason
    c = choose_resume_slot(tmp_path)
    assert (c.path.name, c.step, c.fell_back) == ("ckpt-a", 2, True)
    assert "ckpt-b" in c.rejected


def test_both_damaged_means_no_resume(tmp_path):
    for slot, step in (("ckpt-a", 2), ("ckpt-b", 4)):
        (_write(tmp_path, slot, step) / MANIFEST).unlink()
    c = choose_resume_slot(tmp_path)
    assert c.path is None and set(c.rejected) == {"ckpt-a", "ckpt-b"}


def test_sigkill_before_manifest_leaves_old_checkpoints_intact(tmp_path):
    _write(tmp_path, "ckpt-a", 2)
    _write(tmp_path, "ckpt-b", 4)
    before = (tmp_path / "ckpt-a" / MANIFEST).read_text()
    script = textwrap.dedent(f"""
        import os, signal, torch
        from pathlib import Path
        from moe_launch.trainer.checkpoint.store import write_checkpoint
        from moe_launch.trainer.dist import Comm
        write_checkpoint(Path({str(tmp_path)!r}) / "ckpt-a", 6, {{"model/dense.pt": {{"w": torch.ones(1000)}}}},
                         Comm(), after_shards=lambda: os.kill(os.getpid(), signal.SIGKILL))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    assert (tmp_path / ".ckpt-a.tmp" / "model/dense.pt").exists()  # the half-written one stays invisible
    assert (tmp_path / "ckpt-a" / MANIFEST).read_text() == before
    c = choose_resume_slot(tmp_path)
    assert (c.path.name, c.step, c.fell_back) == ("ckpt-b", 4, False)
    _write(tmp_path, next_slot("ckpt-b"), 6)  # the next write cleans the stale temp dir up
    assert not (tmp_path / ".ckpt-a.tmp").exists() and choose_resume_slot(tmp_path).step == 6
    assert json.loads((tmp_path / "ckpt-a" / MANIFEST).read_text())["step"] == 6
