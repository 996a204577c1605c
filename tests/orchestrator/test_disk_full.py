"""A full disk and other ends the supervisor cannot run through: the login side survives its own write errors and
still prints the reason, the supervisor stops with "no space left on <path>", a torn journal line is skipped with a
warning and never swallows the next record, and a SIGTERMed supervisor leaves a journal record.

The ENOSPC errors are the kernel's: /dev/full, and a small tmpfs filled up under a live run (that one needs the
right to mount, and is skipped without it)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_util import MOE_LAUNCH, wait_for

from moe_launch.orchestrator.last_record import disk_full_reason
from moe_launch.rundir import RunDir, append_jsonl, journal_event, read_jsonl

FAKE = str(Path(__file__).parent / "fake_trainer.py")
FAKE_RUN = [f"supervisor.trainer_command=[{sys.executable},{FAKE}]", "health.preflight=false", "supervisor.poll_s=0.1",
            "train.ckpt_interval=4", "train.step_sleep_s=0.05", "train.steps=100000"]


def test_torn_last_line_is_skipped_with_a_warning_and_never_swallows_the_next(tmp_path, capsys):
    path = tmp_path / "journal.jsonl"
    append_jsonl(path, {"kind": "start", "n": 1})
    with open(path, "ab") as f:
        f.write(b'{"kind": "allocation", "no')  # the writer died mid-line
    append_jsonl(path, {"kind": "launch", "n": 3})
    assert [r["n"] for r in read_jsonl(path)] == [1, 3]
    warned = capsys.readouterr().err
    assert "line 2 is torn" in warned and str(path) in warned
    read_jsonl(path)
    assert capsys.readouterr().err == ""  # once per line, not on every poll


def test_a_full_disk_raises_enospc_naming_the_file(tmp_path):
    journal = tmp_path / "journal.jsonl"
    journal.symlink_to("/dev/full")
    with pytest.raises(OSError) as info:
        append_jsonl(journal, {"kind": "start"})
    assert info.value.errno == errno.ENOSPC


def test_disk_full_reason_prefers_the_supervisors_record(tmp_path):
    rd = RunDir(tmp_path)
    journal_event(rd, "allocation", ("local1",))
    assert disk_full_reason(rd, read_jsonl(rd.journal)) is None  # plenty of space here
    journal_event(rd, "stop", (), reason="no space left on /x/ckpt (No space left on device)", disk_full=True)
    assert disk_full_reason(rd, read_jsonl(rd.journal)).startswith("no space left on /x/ckpt")


def test_sigtermed_supervisor_leaves_a_journal_record(tmp_path):
    login = subprocess.Popen([MOE_LAUNCH, "run.name=t", *FAKE_RUN], cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    rd = tmp_path / "runs" / "t"
    try:
        wait_for(lambda: [m for m in read_jsonl(rd / "metrics.jsonl") if m.get("step", 0) >= 3], 90, "step 3")
        alloc = next(r for r in read_jsonl(rd / "journal.jsonl") if r["kind"] == "allocation")
        os.kill(alloc["details"]["supervisor_pid"], signal.SIGTERM)
        record = wait_for(lambda: next((r for r in read_jsonl(rd / "journal.jsonl")
                                        if r["details"].get("supervisor_terminated")), None), 90, "the record")
        assert "SIGTERM" in record["details"]["message"]
    finally:
        subprocess.run([MOE_LAUNCH, "stop", str(rd)], capture_output=True, timeout=60)
        login.send_signal(signal.SIGINT)
        login.wait(60)


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_run_on_a_disk_that_fills_up_stops_with_no_space_left(small_disk, tmp_path):
    login = subprocess.Popen([MOE_LAUNCH, f"run.root={small_disk / 'runs'}", "run.name=full", *FAKE_RUN],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rd = small_disk / "runs" / "full"
    try:
        wait_for(lambda: [m for m in read_jsonl(rd / "metrics.jsonl") if m.get("step", 0) >= 5], 90, "step 5")
        with open(small_disk / "filler", "wb") as f:  # what a dataset copy or another job does to a shared disk
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
        out, _ = login.communicate(timeout=150)
    finally:
        if login.poll() is None:
            login.kill()
    print(out[-3000:])
    assert login.returncode == 1
    assert "Traceback" not in out  # the login side survived
    assert "run failed: no space left on" in out
    journal = read_jsonl(rd / "journal.jsonl")  # still readable: torn lines skipped
    assert journal and journal[0]["kind"] == "start"
    pid = next(r for r in journal if r["kind"] == "allocation")["details"]["supervisor_pid"]
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 30, "the supervisor to exit")
