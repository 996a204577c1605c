"""The heartbeat file is written off the training thread: a write the file system holds up does not hold up beat()."""

from __future__ import annotations

import json
import os
import threading

import pytest

from moe_launch.rundir import RunDir
from moe_launch.trainer.heartbeat import HeartbeatWriter


def _run_dir(tmp_path) -> RunDir:
    rd = RunDir(tmp_path)
    rd.heartbeat.mkdir(parents=True)
    return rd


def test_beat_returns_while_the_write_is_held_up(tmp_path):
    rd = _run_dir(tmp_path)
    # a FIFO where the writer puts its temporary file: opening it for writing blocks in the kernel until a reader
    # comes, as a rename can block behind the file system's journal
    os.mkfifo(rd.heartbeat / ".rank0.json.tmp")
    hb = HeartbeatWriter(rd, rank=0, host="node-a")
    hb.beat(5)
    hb.beat(6)  # still on the caller's time: the writer is blocked
    assert not (rd.heartbeat / "rank0.json").exists()
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append((rd.heartbeat / ".rank0.json.tmp").read_bytes()))
    reader.start()
    reader.join(30)
    assert json.loads(received[0])["step"] in (5, 6)  # the writer took 5, or 6 had replaced it before it woke
    hb.beat(9)
    hb.close()
    final = json.loads((rd.heartbeat / "rank0.json").read_text())  # the FIFO was renamed away; a file replaced it
    assert final["step"] == 9 and final["host"] == "node-a" and final["pid"] == os.getpid()


def test_close_writes_the_last_step(tmp_path):
    rd = _run_dir(tmp_path)
    hb = HeartbeatWriter(rd, rank=3, host="h")
    for step in range(1, 50):
        hb.beat(step)
    hb.close()
    assert json.loads((rd.heartbeat / "rank3.json").read_text())["step"] == 49
    assert not hb._thread.is_alive()


def test_a_write_error_reaches_the_training_thread(tmp_path):
    rd = RunDir(tmp_path / "missing")  # no heartbeat directory: the write fails
    hb = HeartbeatWriter(rd, rank=0, host="h")
    hb.beat(1)
    with pytest.raises(OSError):
        for _ in range(200):
            hb.beat(2)
            threading.Event().wait(0.05)
    hb.close()
