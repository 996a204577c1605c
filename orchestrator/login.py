"""The login side after the plan: start the supervisor (an sbatch allocation, or a local process), follow the run,
and resubmit when the allocation itself ended without a summary (time limit, preemption, supervisor node lost),
excluding the nodes the journal names as bad and asking for fewer buffers when the partition cannot give them. A
clean time-limit/preemption checkpoint makes the next allocation a continuation; supervisor.max_resubmits counts only
the allocations lost without one (orchestrator/resubmit.py).

Everything it needs is in the run directory, so `moe-launch attach` runs the same follow loop after the original
login session died.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock, Timeout

from moe_launch.conf.schema import RootConfig
from moe_launch.errors import ConfigError, SubmissionError
from moe_launch.orchestrator import slurm
from moe_launch.orchestrator.last_record import DISK_FULL, disk_full_reason, no_space_reason
from moe_launch.orchestrator.live import LiveView
from moe_launch.orchestrator.plan import LaunchPlan, plan, write_plan
from moe_launch.orchestrator.render import render_sbatch
from moe_launch.orchestrator.resubmit import (
    allocation_never_started,
    allocation_verdict,
    buffers_for_resubmit,
    pending_cannot_start,
    submitted_at,
)
from moe_launch.orchestrator.state import Action, SupervisorState, replay
from moe_launch.orchestrator.summary import build_summary, write_summary
from moe_launch.orchestrator.supervisor import STOP_FILE
from moe_launch.rundir import RunDir, journal_event, read_jsonl

# not COMPLETING: the batch script (the supervisor) has exited then, so nothing watches or writes the run any more,
# and a new start of the run must not be refused while Slurm cleans the job up
_LIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "SUSPENDED", "REQUEUED", "RESIZING")
STOPPED_BEFORE_START = "stopped by the user before the allocation ran"
_GONE_GRACE_S = 3.0  # the supervisor writes summary.json just before it exits; give the file a moment
_YOUNG_JOB_S = 60.0


def partition_and_quarantine(cfg: RootConfig) -> tuple[Any, list[str]]:
    """Ask Slurm about the partition and moe-health about quarantined nodes (cluster.kind=slurm only)."""
    if cfg.cluster.kind != "slurm":
        return None, []
    quarantined: list[str] = []
    try:
        from moe_launch.health import store

        quarantined = sorted(store.quarantined_nodes(store.cluster_dir(cfg.health, cfg.cluster.name)))
    except ImportError:
        pass
    return slurm.partition_info(cfg.cluster.partition, cfg.cluster.controller_retry_s), quarantined


def make_plan(cfg: RootConfig, run_dir: Path, extra_exclude: tuple[str, ...] = ()) -> LaunchPlan:
    if extra_exclude:
        cfg = replace(cfg, cluster=replace(cfg.cluster, exclude=list(dict.fromkeys([*cfg.cluster.exclude,
                                                                                      *extra_exclude]))))
    part, quarantined = partition_and_quarantine(cfg)
    return plan(cfg, part, quarantined, run_dir=str(run_dir))


def start_allocation(p: LaunchPlan, rd: RunDir, number: int, retry_s: float = 0.0) -> str:
    """Start the supervisor; returns the handle journaled for attach (a Slurm job id, or a local pid). sbatch is
    retried for `retry_s` while the controller cannot be reached."""
    write_plan(p, rd.root)  # the allocation's supervisor reads its plan from there
    if p.kind == "slurm":
        script = rd.root / "sbatch" / f"allocation-{number}.sh"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(render_sbatch(p))
        return slurm.submit(script, retry_s)
    if number > 0:
        _kill_local_leftovers(rd)
    log = open(rd.logs / f"supervisor-{number}.log", "ab")
    proc = subprocess.Popen(list(p.supervisor_argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=rd.root, start_new_session=True)  # survives the login session
    _CHILDREN[proc.pid] = proc
    return str(proc.pid)


_CHILDREN: dict[int, subprocess.Popen] = {}  # local supervisors started by this process (reaped when they exit)


def _kill_local_leftovers(rd: RunDir) -> None:
    """A local "allocation" that ended (its supervisor died) leaves its trainer processes behind, unlike a Slurm job
    whose end kills its steps: end those of this run (pids from the heartbeats, checked against their command line)."""
    for path in rd.heartbeat.glob("rank*.json"):
        try:
            pid = int(json.loads(path.read_text())["pid"])
            if str(rd.root) in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                os.killpg(pid, signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            continue


def handle_alive(kind: str, handle: str, retry_s: float = 0.0, submitted_s_ago: float = float("inf")) -> bool:
    """Is the allocation still there? A controller that stays unreachable for retry_s leaves it unknown: alive. So
    does a job Slurm does not know yet (accounting lags the controller) within _YOUNG_JOB_S of its submission."""
    if kind == "slurm":
        try:
            state = slurm.job_state(handle, retry_s)
        except SubmissionError:
            return True
        return state in _LIVE_STATES or (state == "" and submitted_s_ago < _YOUNG_JOB_S)
    pid = int(handle)
    if pid in _CHILDREN:
        return _CHILDREN[pid].poll() is None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z" and "moe_launch.orchestrator.supervisor" in Path(f"/proc/{pid}/cmdline").read_text()
    except (OSError, IndexError):
        return False


def handles(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The allocations the login side started, oldest first (journal kinds start / resubmit)."""
    return [r["details"] for r in records
            if r.get("kind") in ("start", "resubmit") and "handle" in r.get("details", {})]


def submit(cfg: RootConfig, rd: RunDir, p: LaunchPlan) -> str:
    handle = start_allocation(p, rd, 0, cfg.cluster.controller_retry_s)
    journal_event(rd, "start", (), handle=handle, cluster=p.kind, nodes_wanted=p.nodes, buffers=p.buffers,
                  exclude=list(p.exclude), warnings=list(p.warnings), login_pid=os.getpid())
    return handle


def follow(cfg: RootConfig, rd: RunDir, quiet: bool = False) -> int:
    """Follow until summary.json exists, resubmitting dead allocations. Exit code: 0 completed, 1 otherwise."""
    view = None if quiet else LiveView(rd, cfg.cluster.nodes, cfg.supervisor.max_restarts, cfg.train.steps)
    try:
        _follow_until_summary(cfg, rd, view)
    except KeyboardInterrupt:  # the run goes on without us
        print(f"\ndetached; the run continues. Follow it again with `moe-launch attach {rd.root}`, "
              f"stop it with `moe-launch stop {rd.root}`", file=sys.stderr)
        return 130
    finally:
        if view is not None:
            view.update()
            view.close()
    summary = read_summary(rd) or _UNWRITTEN.get(str(rd.root), {})
    print(f"run {summary.get('status')}: {summary.get('reason', '')}\n  outputs: {rd.root}", file=sys.stderr)
    return 0 if summary.get("status") == "completed" else 1


class _ResubmitLock:
    """Only one follower (the original login session or an `attach`) may resubmit: a file lock on
    runs/<name>/.login.lock, taken without blocking and kept; the others only watch, and take over when the holder's
    process ends."""

    def __init__(self, rd: RunDir):
        self.lock = FileLock(rd.root / ".login.lock")
        self.held = False

    def acquire(self) -> bool:
        if not self.held:
            try:
                self.lock.acquire(timeout=0)
                self.held = True
            except Timeout:
                pass
        return self.held


def _follow_until_summary(cfg: RootConfig, rd: RunDir, view: Optional[LiveView]) -> None:
    gone_since: Optional[float] = None
    lock = _ResubmitLock(rd)
    while True:
        if view is not None:
            view.update()
        if rd.summary.exists() or str(rd.root) in _UNWRITTEN:
            return
        records = read_jsonl(rd.journal)
        started = handles(records)
        if not started:
            raise SubmissionError(f"{rd.journal} names no allocation; was this run started by moe-launch?")
        last = started[-1]
        alive = handle_alive(last["cluster"], last["handle"], cfg.cluster.controller_retry_s,
                             time.time() - submitted_at(records, last["handle"]))
        cancelled = last["handle"] in _CANCELLED  # by this process, to submit again: gone once Slurm says so
        if alive and not (cancelled or _supervisor_lost(rd, records, last) or _pending_replanned(cfg, rd, last)):
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since > _GONE_GRACE_S and not rd.summary.exists() and lock.acquire():
            fresh = read_jsonl(rd.journal)  # another follower may have resubmitted before we got the lock
            if handles(fresh)[-1]["handle"] == last["handle"]:
                try:
                    _allocation_ended(cfg, rd, fresh, len(handles(fresh)))
                except OSError as e:  # our own writes failed (disk full, ...): stop, and say why
                    why = no_space_reason(e, str(rd.root)) if e.errno in DISK_FULL else f"the login side failed: {e}"
                    _final(rd, None, time.time() - fresh[0]["time"], "failed", why, len(handles(fresh)) - 1)
            gone_since = None
        time.sleep(min(cfg.supervisor.poll_s * 2, 1.0))


_CANCELLED: set[str] = set()  # allocations this process cancelled to submit again


def _supervisor_lost(rd: RunDir, records: list[dict[str, Any]], last: dict[str, Any]) -> bool:
    """cluster=slurm: with --no-kill the job outlives the node its batch script (the supervisor) ran on; nobody then
    watches the trainer. Seen as that node gone from the job's NodeList: cancel the job so it is resubmitted."""
    if last["cluster"] != "slurm":
        return False
    allocs = [r for r in records if r.get("kind") == "allocation" and r["details"].get("job_id") == last["handle"]]
    host = allocs[-1]["details"].get("supervisor_host") if allocs else None
    if host is None:
        return False
    try:
        proc = slurm._run(["scontrol", "show", "job", "-o", last["handle"]], check=False)
        nodes = slurm.hostnames(slurm.parse_job_field(proc.stdout, "NodeList") or "")
    except SubmissionError:
        return False  # a slurmctld hiccup: ask again next time
    # only a RUNNING job: while COMPLETING, NodeList shows just the nodes still completing (a dead one, say)
    running = slurm.parse_job_field(proc.stdout, "JobState") == "RUNNING"
    if proc.returncode != 0 or not running or not nodes or host in nodes:
        return False
    _CANCELLED.add(last["handle"])
    journal_event(rd, "failure", (host,), supervisor_lost=True,
                  reason=f"allocation {last['handle']} lost its supervisor's node {host}; cancelling it to resubmit")
    slurm.cancel(last["handle"])
    return True


_PENDING_CHECK_S = 5.0
_pending_checked: dict[str, float] = {}  # allocation -> when this process last asked whether it can still start


def _pending_replanned(cfg: RootConfig, rd: RunDir, last: dict[str, Any]) -> bool:
    """cluster=slurm: a pending allocation sized before a node died would pend until that node returns. Seen as the
    partition unable to give its N + B nodes but able to give N: cancel it, so it is submitted again with fewer
    buffers (resubmit.pending_cannot_start)."""
    handle = last["handle"]
    if last["cluster"] != "slurm":
        return False
    now = time.monotonic()
    if now - _pending_checked.get(handle, float("-inf")) < _PENDING_CHECK_S:
        return False
    _pending_checked[handle] = now
    try:
        if slurm.job_state(handle) != "PENDING":
            return False
        part = slurm.partition_info(cfg.cluster.partition)
    except SubmissionError:
        return False  # a slurmctld hiccup: ask again next time
    why = pending_cannot_start(part, cfg.cluster.nodes, int(last.get("buffers") or 0),
                               tuple(last.get("exclude") or ()))
    if why is None:
        return False
    _CANCELLED.add(handle)
    journal_event(rd, "info", (), message=f"allocation {handle} cannot start: {why}; cancelling it to submit it "
                  "again with fewer buffer nodes", warning=True, job=handle)
    slurm.cancel(handle, if_state="PENDING")
    return True


def _allocation_ended(cfg: RootConfig, rd: RunDir, records: list[dict[str, Any]], started: int) -> None:
    state = replay(records, cfg.cluster.nodes, cfg.supervisor.max_restarts)
    resubmits = started - 1
    wall = time.time() - records[0]["time"]
    if (rd.root / STOP_FILE).exists():
        return _final(rd, state, wall, "stopped", STOPPED_BEFORE_START, resubmits)
    full = disk_full_reason(rd, records)
    if full:  # a new allocation would fail the same way
        return _final(rd, state, wall, "failed", full, resubmits)
    last = handles(records)[-1]
    never_started = allocation_never_started(records, last)
    if never_started:  # the replayed state is the previous allocation's: this one is no continuation of anything
        try:
            job_state = slurm.job_state(last["handle"], cfg.cluster.controller_retry_s) or "unknown to Slurm"
        except SubmissionError:
            job_state = "unknown (slurmctld unreachable)"
        journal_event(rd, "info", (), message=f"allocation {last['handle']} ended ({job_state}) before its supervisor "
                      "started", never_started=True, job=last["handle"], job_state=job_state, warning=True)
    continuation = state is not None and state.status == "preempted" and not never_started
    why_stop = allocation_verdict(continuation, records, started, cfg.supervisor)
    allocs = [r for r in records if r.get("kind") == "allocation"]  # name the node the ended supervisor ran on
    lost_host = allocs[-1]["details"].get("supervisor_host") if allocs else None
    # the supervisor's own lost node is known only to the login side, and so are nodes that died with it; they are
    # journaled as an action, so replay (the next supervisor, the summary) counts them as excluded
    newly = _nodes_lost_with_allocation(cfg, records, allocs[-1]["nodes"] if allocs else [], state)
    if newly:
        journal_event(rd, "exclude", tuple(newly), reason="lost with the allocation",
                      action=Action(kind="update", exclude=newly, reason="lost with the allocation").to_json())
        state = replay(read_jsonl(rd.journal), cfg.cluster.nodes, cfg.supervisor.max_restarts)
    if why_stop:
        return _final(rd, state, wall, "failed", why_stop, resubmits)
    excluded = tuple(dict.fromkeys([*(state.excluded if state else ()), *newly]))
    try:
        part, _ = partition_and_quarantine(cfg)
        buffers = buffers_for_resubmit(cfg.cluster, part, tuple(dict.fromkeys([*cfg.cluster.exclude, *excluded])))
        if buffers < cfg.cluster.buffers:
            journal_event(rd, "info", (), message=f"resubmitting with {buffers} buffer node(s) instead of "
                          f"cluster.buffers={cfg.cluster.buffers}: the partition has no more usable nodes "
                          f"({len(excluded)} excluded)", warning=True)
        p = make_plan(replace(cfg, cluster=replace(cfg.cluster, buffers=buffers)), rd.root, excluded)
        handle = start_allocation(p, rd, started, cfg.cluster.controller_retry_s)
    except (ConfigError, SubmissionError) as e:
        return _final(rd, state, wall, "failed", f"the allocation ended and a new one cannot be submitted: {e}",
                      resubmits)
    journal_event(rd, "resubmit", excluded, handle=handle, cluster=p.kind, number=started, exclude=list(p.exclude),
                  previous_supervisor_host=lost_host, previous_job=handles(records)[-1]["handle"],
                  continuation=continuation, never_started=never_started, buffers=buffers,
                  reason="continuation after a clean time-limit/preemption checkpoint" if continuation else
                  "the allocation ended before its supervisor started" if never_started else
                  "the allocation ended without a clean checkpoint (supervisor node lost, hard time limit, ...)")


def _nodes_lost_with_allocation(cfg: RootConfig, records: list[dict[str, Any]], nodes: list[str],
                                state: Optional[SupervisorState]) -> dict[str, str]:
    """Nodes of the ended allocation not yet excluded that were lost: the supervisor's node (seen by the login side),
    and those the scheduler now reports down or not responding."""
    known = set(state.excluded) if state else set()
    lost = {n: "the supervisor's node was lost" for r in records if r.get("kind") == "failure"
            and r["details"].get("supervisor_lost") for n in r["nodes"]}
    if cfg.cluster.kind == "slurm" and nodes:
        try:
            down = slurm.partition_info(cfg.cluster.partition, cfg.cluster.controller_retry_s)
        except SubmissionError:
            down = None
        for n in nodes:
            if down is not None and n in down.unavailable:
                lost.setdefault(n, "down when its allocation ended")
    return {n: why for n, why in lost.items() if n not in known}


_UNWRITTEN: dict[str, dict[str, str]] = {}  # run dir -> the outcome this process could not write (disk full, ...)


def _final(rd: RunDir, state, wall: float, status: str, reason: str, resubmits: int) -> None:
    st = state or SupervisorState(want=0, max_restarts=0)
    try:
        journal_event(rd, "stop", (), reason=reason, status=status)
        write_summary(rd, build_summary(rd, st, wall, status=status, reason=reason, resubmits=resubmits))
    except OSError as e:  # the outcome still reaches the terminal
        _UNWRITTEN[str(rd.root)] = {"status": status, "reason": f"{reason} (not recorded: {e})"}


def read_summary(rd: RunDir) -> dict[str, Any]:
    try:
        return json.loads(rd.summary.read_text())
    except (OSError, ValueError):
        return {}


def request_stop(cfg: RootConfig, rd: RunDir) -> str:
    """Ask the supervisor to checkpoint and stop; a Slurm job that has not started is cancelled. Its outcome is
    recorded by the run's follower (the login side or an `attach`), or here when none follows: no supervisor ever
    ran to write it."""
    (rd.root / STOP_FILE).write_text(f"requested at {time.time()}\n")
    records = read_jsonl(rd.journal)
    started = handles(records)
    if started and started[-1]["cluster"] == "slurm":
        job = started[-1]["handle"]
        if slurm.job_state(job) == "PENDING":
            slurm.cancel(job, if_state="PENDING")  # a job that started meanwhile is its supervisor's to stop
            if slurm.job_state(job) == "CANCELLED":
                if not rd.summary.exists() and _ResubmitLock(rd).acquire():  # held by a live follower otherwise
                    _final(rd, replay(records, cfg.cluster.nodes, cfg.supervisor.max_restarts),
                           time.time() - records[0]["time"], "stopped", STOPPED_BEFORE_START, len(started) - 1)
                return f"job {job} was pending and is cancelled"
    return "stop requested: the supervisor checkpoints the trainer and stops"
