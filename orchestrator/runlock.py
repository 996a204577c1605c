"""One live start per run directory.

`moe-launch run.name=x` twice (started together, or again after the first login session died) must not make a second
allocation in the same run directory: two trainers would share `ckpt-a`/`ckpt-b` and the journal. A start therefore
  1. takes an exclusive lock on runs/<name>/.start.lock (filelock; a concurrent start waits for it), and
  2. under the lock, looks for a live allocation of this run: the journal's last handle, and also one the journal
     never heard of (the login side killed between starting it and journaling it): a local supervisor process of
     this run directory, or a Slurm job whose batch script lies in runs/<name>/sbatch/;
  3. refuses with the `attach` command when it finds one, else starts, journals and only then releases the lock.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Optional

from filelock import FileLock, Timeout

from moe_launch.errors import SubmissionError

LOCK_NAME = ".start.lock"
_WAIT_S = 60.0  # a concurrent start holds the lock for one submission (sbatch answers within seconds)


class RunLock:
    def __init__(self, run_dir: Path, wait_s: float = _WAIT_S):
        self.path = Path(run_dir) / LOCK_NAME
        self.wait_s = wait_s
        self.lock = FileLock(self.path, timeout=wait_s)

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.lock.acquire()
        except Timeout:
            raise SubmissionError(f"another moe-launch has been starting {self.path.parent} for "
                                  f"{self.wait_s:.0f} s; follow it with `moe-launch attach "
                                  f"{self.path.parent}`") from None
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


def local_supervisors(run_dir: Path, proc_root: Path = Path("/proc")) -> list[str]:
    """Pids of live local supervisors of `run_dir` (their command line names it)."""
    want = ["moe_launch.orchestrator.supervisor", "--run-dir", str(Path(run_dir).absolute())]
    found = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and all(w in argv for w in want):
            found.append(entry.name)
    return found


def squeue_all() -> str:
    """`squeue -h -o %i|%T|%o` (job id, state, batch script); '' when Slurm does not answer."""
    try:
        return subprocess.run(["squeue", "-h", "-o", "%i|%T|%o"], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def slurm_jobs_of(run_dir: Path, squeue_lines: str) -> list[str]:
    """Pure: ids of live jobs in `squeue -h -o %i|%T|%o` output whose batch script lies in run_dir/sbatch/."""
    scripts = str(Path(run_dir).absolute() / "sbatch") + os.sep
    # COMPLETING too: its batch script, the supervisor, has exited; only Slurm's cleanup is left
    done = ("COMPLETED", "COMPLETING", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL")
    jobs = []
    for line in squeue_lines.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) == 3 and parts[2].startswith(scripts) and parts[1] not in done:
            jobs.append(parts[0])
    return jobs


def live_allocation(run_dir: Path, kind: str, journal_handles: list[dict], handle_alive: Callable[[str, str], bool],
                    squeue: Optional[Callable[[], str]] = None) -> Optional[str]:
    """A description of a live allocation of this run, or None. Checks the journal first, then the machine."""
    if journal_handles:
        last = journal_handles[-1]
        if handle_alive(last["cluster"], last["handle"]):
            return f"{last['cluster']} allocation {last['handle']}"
    if kind == "local":
        pids = local_supervisors(run_dir)
        return f"local supervisor pid {', '.join(pids)}" if pids else None
    jobs = slurm_jobs_of(run_dir, squeue()) if squeue else []
    return f"Slurm job {', '.join(jobs)}" if jobs else None


def refusal(run_dir: Path, what: str) -> str:
    return (f"run {Path(run_dir).name} is already running ({what}); a second start would put two trainers in "
            f"{run_dir}. Follow it with `moe-launch attach {run_dir}`, or stop it with `moe-launch stop {run_dir}` "
            f"and start again")
