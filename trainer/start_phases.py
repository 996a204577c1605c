"""When this trainer process reached each phase of its start: the trainer's half of the recovery breakdown.

A (re)launched trainer spends its first seconds in
  process start   interpreter, imports, CUDA context, process-group rendezvous, model build, data loader open
  restore         choose and load the checkpoint (weights, optimizer, RNG, data position), build the optimizer
  first step      the first optimizer step, of which `compile` is torch.compile's tracing and code generation
Rank 0 writes the wall-clock times to heartbeat/start-rank0.json within its first step; the supervisor joins
them with its own times (failure, detection, relaunch) into the `breakdown` of its resume record
(orchestrator/recovery.py). Wall clock (time.time), not a monotonic clock, because another process, possibly on
another node, compares them with its own (the nodes of a cluster keep NTP-synced clocks).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psutil

from moe_launch.rundir import RunDir, write_json_atomic

START_FILE = "start-rank0.json"


class _CompileTimer:
    """Seconds this process spent inside torch.compile (Dynamo's compile start/end callbacks; nested compiles are
    reported once by Dynamo, so the windows do not overlap)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0: Optional[float] = None
        self._lock = threading.Lock()
        self._registered = False

    def register(self) -> None:
        if self._registered:
            return
        from torch._dynamo import callback

        # the callbacks take a CallbackArgs on newer torch and nothing on older ones
        callback.on_compile_start(self._start)
        callback.on_compile_end(self._end)
        self._registered = True

    def _start(self, *_args: Any) -> None:
        with self._lock:
            self._t0 = time.perf_counter()

    def _end(self, *_args: Any) -> None:
        with self._lock:
            if self._t0 is not None:
                self.seconds += time.perf_counter() - self._t0
                self._t0 = None


COMPILE_TIMER = _CompileTimer()


PROCESS_START_ENV = "MOE_LAUNCH_PROCESS_START"


def process_start_time() -> float:
    """Wall-clock time at which this rank's process started: the OS's creation time of this process (before the
    interpreter ran a line), or, in a warm standby that took over a launched task, that task's (the standby passes
    it in MOE_LAUNCH_PROCESS_START; its own process started long before the failure). On Linux from the
    process's start in clock ticks since boot and the uptime (10 ms resolution); psutil's answer counts from an
    integer boot second, up to a second off, which would swamp a sub-second relaunch."""
    if os.environ.get(PROCESS_START_ENV):
        return float(os.environ[PROCESS_START_ENV])
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the command name may contain spaces
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        started_s = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): starttime
        return time.time() - (uptime_s - started_s)
    except (OSError, ValueError, IndexError):
        return psutil.Process().create_time()


class StartPhases:
    """Marks `restore_start` and `restore_end` as the trainer reaches them, then `first_backward_done` once. Compiling
    is lazy (at the first forward and backward), so the compile seconds between the Trainer's construction and then
    are the first step's (a warm standby's ahead-of-time compile comes before and is not counted)."""

    def __init__(self, attempt: int, compiled: bool):
        self.attempt = attempt
        self.times: dict[str, float] = {"process_start": process_start_time()}
        self.compile_s = 0.0
        self.pending = True  # until the first step's forward/backward is done
        if compiled:
            COMPILE_TIMER.register()
        self._compile_before = COMPILE_TIMER.seconds

    def mark(self, phase: str) -> None:
        self.times[phase] = time.time()

    def first_backward_done(self, run_dir: RunDir, write: bool) -> None:
        """After the first step's forward/backward, before its collective: every rank's first heartbeat comes after
        that collective, so the file is there when the supervisor sees one. `write` on one rank only (rank 0)."""
        self.compile_s = COMPILE_TIMER.seconds - self._compile_before
        if write:
            write_json_atomic(run_dir.heartbeat / START_FILE, self.record())
        self.pending = False

    def record(self) -> dict[str, Any]:
        return {"attempt": self.attempt, **{k: round(v, 3) for k, v in self.times.items()},
                "compile_s": round(self.compile_s, 3)}


def read_start_record(heartbeat_dir: Path, attempt: int) -> Optional[dict[str, Any]]:
    """The start record of `attempt` (the supervisor's side), or None: not written, torn, or an earlier attempt's."""
    try:
        rec = json.loads((heartbeat_dir / START_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) and rec.get("attempt") == attempt else None
