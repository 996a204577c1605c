"""How a supervisor that cannot go on still leaves a record: SIGTERM, and a full disk.

* SIGTERM (scancel, the end of the allocation, a local kill): the trainer step is asked to checkpoint and ended, a
  journal record says so, and no summary is written: the run is not over, the login side decides (resubmit or stop).
* No space left (ENOSPC / EDQUOT) on any write of the supervisor: the step is ended and the run stops with
  "no space left on <path>". The record goes wherever it still fits: the journal (appends often still fit in the
  file's last block), summary.json, and always stderr (the allocation's log, or the login side's terminal).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Any, Optional

from moe_launch.orchestrator.summary import build_summary, write_summary
from moe_launch.rundir import RunDir, journal_event, read_jsonl

EXIT_TERMINATED = 128 + signal.SIGTERM
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_MIN_FREE_BYTES = 1 << 20  # below this a supervisor cannot even journal and write its summary


class Terminated(Exception):
    """SIGTERM arrived; raised in the main thread so the loop unwinds to `run_recorded`."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def no_space_reason(err: OSError, fallback: str) -> str:
    """Pure: the stop reason of a write that found no space."""
    return f"no space left on {err.filename or fallback} ({err.strerror or 'ENOSPC'}); free space, then run " \
           f"moe-launch again with the same run.name to resume from the newest valid checkpoint"


def run_recorded(sup: Any) -> int:
    """`sup.run()`, with a record left when SIGTERM or a full disk ends it."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return sup.run()
    except Terminated:
        _wind_down(sup, graceful=True)
        _best_effort(lambda: journal_event(sup.rd, "info", (), message="supervisor terminated (SIGTERM); the trainer "
                                           "step was asked to checkpoint and ended", supervisor_terminated=True))
        _best_effort(lambda: print("supervisor: terminated by SIGTERM", file=sys.stderr, flush=True))
        return EXIT_TERMINATED
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        reason = no_space_reason(e, str(sup.rd.root))
        _wind_down(sup, graceful=False)
        _best_effort(lambda: journal_event(sup.rd, "stop", (), reason=reason, status="failed", disk_full=True))
        state = getattr(sup, "state", None)
        if state is not None:
            records = _best_effort(lambda: read_jsonl(sup.rd.journal)) or []
            wall = time.time() - (records[0]["time"] if records else time.time())
            _best_effort(lambda: write_summary(sup.rd, build_summary(sup.rd, state, wall, status="failed",
                                                                     reason=reason)))
        _best_effort(lambda: print(f"supervisor: {reason}", file=sys.stderr, flush=True))  # its log may be full too
        return 1


def _wind_down(sup: Any, graceful: bool) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the wind-down
    for name in ("scheduler", "standbys"):
        if hasattr(sup, name):
            _best_effort(getattr(sup, name).stop)
    _best_effort(lambda: sup._end_step(graceful=graceful))


def _best_effort(fn: Any) -> Any:
    try:
        return fn()
    except OSError:
        return None


def disk_full_reason(rd: RunDir, records: list[dict[str, Any]]) -> Optional[str]:
    """For the login side, when an allocation ended without a summary: the supervisor's own disk-full record since
    the last allocation, else "no space left" when the run directory's file system is (almost) full, else None."""
    allocs = [i for i, r in enumerate(records) if r.get("kind") == "allocation"]
    for r in records[allocs[-1] if allocs else 0:]:
        if r.get("kind") == "stop" and r.get("details", {}).get("disk_full"):
            return r["details"]["reason"]
    try:
        st = os.statvfs(rd.root)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize >= _MIN_FREE_BYTES:
        return None
    return no_space_reason(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(rd.root)), str(rd.root))
