"""Helpers for the end-to-end tests: run the real `moe-launch` console script, watch its run directory, kill ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from moe_launch.rundir import read_jsonl

MOE_LAUNCH = str(Path(sys.executable).with_name("moe-launch"))
# tiny and quick: the machine has 2 cores shared by the whole suite
FAST = ["train.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=2", "train.ckpt_interval=3",
        "train.progress=false", "supervisor.poll_s=0.2"]


def start(tmp_path: Path, name: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "runs" / name
    log = open(tmp_path / f"{name}.out", "wb")
    proc = subprocess.Popen([MOE_LAUNCH, f"run.root={tmp_path / 'runs'}", f"run.name={name}", *overrides],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, run_dir


def finish(proc: subprocess.Popen, tmp_path: Path, name: str, timeout: float) -> tuple[int, dict[str, Any], list]:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        print((tmp_path / f"{name}.out").read_text()[-6000:])
    run_dir = tmp_path / "runs" / name
    summary = json.loads((run_dir / "summary.json").read_text())
    return code, summary, read_jsonl(run_dir / "journal.jsonl")


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def metrics_step(run_dir: Path) -> int:
    rows = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "step" in m]
    return rows[-1]["step"] if rows else 0


def rank_pids_on(run_dir: Path, host: str) -> list[int]:
    pids = []
    for path in (run_dir / "heartbeat").glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
        except ValueError:
            continue
        if beat["host"] == host:
            pids.append(int(beat["pid"]))
    return pids


def kill_ranks_on(run_dir: Path, host: str) -> float:
    """SIGKILL every trainer process of `host` (pids from the heartbeats); returns the time of the kill."""
    pids = rank_pids_on(run_dir, host)
    assert pids, f"no heartbeat names {host}"
    t = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return t


def newest_checkpoint_step(journal: list, before: float) -> Optional[int]:
    steps = [r["details"]["step"] for r in journal
             if r["kind"] == "checkpoint" and r["time"] <= before and not r["details"].get("model_only")]
    return max(steps) if steps else None


def story(journal: list) -> list[str]:
    return [r["kind"] for r in journal]


def first(journal: list, kind: str, after: float = 0.0, key: Optional[str] = None) -> dict:
    """The first record of `kind` at or after `after` (whose details have `key`, if given)."""
    return next(r for r in journal if r["kind"] == kind and r["time"] >= after and (key is None or key in r["details"]))


def supervisor_resume(journal: list, after: float = 0.0) -> dict:
    return first(journal, "resume", after, "seconds_since_failure")


def trainer_resume(journal: list, after: float = 0.0) -> dict:
    return first(journal, "resume", after, "checkpoint")
