"""Per-rank heartbeats: heartbeat/rank{R}.json = {step, time, host, pid}, read by the supervisor's hang detection.

The file is replaced by a thread of its own. While a checkpoint's gigabytes are being written back, a rename in the
run directory can wait for the file system's journal for a tenth of a second or more; on the training thread that
cost every step (on 1×H200 it was 28% of the training thread's time while a 26 GB checkpoint persisted). The
training thread only hands the step over. A rank that hangs hands nothing over, so its heartbeat still goes stale.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional

from moe_launch.rundir import RunDir


def write_heartbeat(run_dir: RunDir, rank: int, step: int, host: str) -> None:
    """Whole-file replace without fsync: readers need an untorn file, not durability, and an fsync per step
    costs more than a tiny model's step on a busy disk."""
    path = run_dir.heartbeat / f"rank{rank}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"step": step, "time": time.time(), "host": host, "pid": os.getpid()}))
    os.replace(tmp, path)


class HeartbeatWriter:
    """beat(step) returns at once; the newest step handed over is written next (steps in between may be skipped:
    only the newest matters). A write error is raised on the training thread at its next beat()."""

    def __init__(self, run_dir: RunDir, rank: int, host: str):
        self.run_dir, self.rank, self.host = run_dir, rank, host
        self._cond = threading.Condition()
        self._pending: Optional[int] = None
        self._closed = False
        self._error: Optional[OSError] = None
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{rank}", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        with self._cond:
            self._raise_error()
            self._pending = step
            self._cond.notify()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write the last step handed over, then stop the thread. Raises nothing: it runs on the way out, also of a
        crash, whose own error must not be masked."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                step, self._pending = self._pending, None
            if step is None:  # closed, nothing left to write
                return
            try:
                write_heartbeat(self.run_dir, self.rank, step, self.host)
            except OSError as e:
                with self._cond:
                    self._error = e
