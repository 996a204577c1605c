"""Checkpoint files held in host memory (trainer/host_restore.py): a held slot verifies and loads without reading its
files again, and the moment a file is replaced or corrupted on disk the disk is what counts again."""

from __future__ import annotations

import os
import time

import pytest
import torch

from moe_launch.trainer import host_restore
from moe_launch.trainer.checkpoint.store import load_file, verify, write_checkpoint
from moe_launch.trainer.dist import Comm


@pytest.fixture(autouse=True)
def _nothing_held(monkeypatch):
    monkeypatch.setattr(host_restore, "_held", None)  # the held slot is per process: each test starts without one


def _slot(root, step: int, value: float):
    return write_checkpoint(root / "ckpt-a", step, {"model/dense.pt": {"w": torch.full((4, 4), value)},
                                                    "trainer.pt": {"step": step}}, Comm())


def test_held_slot_is_verified_and_loaded_from_memory(tmp_path):
    slot = _slot(tmp_path, 3, 1.5)
    assert host_restore.hold(slot) and host_restore.held_step() == 3 and host_restore.is_held(slot)
    held = host_restore.held_file(slot / "model/dense.pt")
    assert torch.equal(held["w"], torch.full((4, 4), 1.5))
    assert load_file(slot, "model/dense.pt") is held  # the resume's read is the held object
    assert verify(slot) == (True, "ok")


def test_a_replaced_or_corrupted_file_is_read_from_disk_again(tmp_path):
    slot = _slot(tmp_path, 3, 1.5)
    assert host_restore.hold(slot)
    time.sleep(0.01)
    _slot(tmp_path, 6, 2.5)  # the next checkpoint into the same slot replaces its files
    assert not host_restore.is_held(slot) and host_restore.held_file(slot / "model/dense.pt") is None
    assert torch.equal(load_file(slot, "model/dense.pt")["w"], torch.full((4, 4), 2.5))
    assert host_restore.hold(slot)
    path = slot / "model/dense.pt"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(bytes(data))  # corrupted in place: a new mtime, so the digest is checked again
    os.utime(path, ns=(time.time_ns(), time.time_ns()))
    ok, reason = verify(slot)
    assert not ok and "mismatch" in reason


def test_a_corrupt_slot_is_not_held(tmp_path):
    slot = _slot(tmp_path, 3, 1.5)
    path = slot / "model/dense.pt"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not host_restore.hold(slot) and host_restore.held_step() is None


def test_hold_newest_follows_the_newest_slot(tmp_path):
    write_checkpoint(tmp_path / "ckpt-b", 3, {"trainer.pt": {"step": 3}}, Comm())
    write_checkpoint(tmp_path / "ckpt-a", 6, {"trainer.pt": {"step": 6}}, Comm())
    holder = host_restore.HoldNewest(tmp_path)
    try:
        deadline = time.monotonic() + 30
        while host_restore.held_step() != 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        holder.stop()
    assert host_restore.held_step() == 6 and host_restore.is_held(tmp_path / "ckpt-a")
