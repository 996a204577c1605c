"""The supervisor: `python -m moe_launch.orchestrator.supervisor --run-dir RUN_DIR`.

Runs inside the allocation on its first node (cluster.kind=slurm) or as a local process (cluster.kind=local).
Loop: observe -> event -> decide() -> journal -> act. Observations: the trainer step's exit (and, on Slurm, srun's
stderr as it arrives), fault records, heartbeats (hang / launch timeout), the scheduler's view of the nodes, and a
`STOP` file written by `moe-launch stop`. All decisions are decide()'s; this file only carries them out.

A supervisor started on a new allocation (the login side resubmitted) rebuilds the earlier state from the journal, so
exclusions, restart counts and attempt numbers carry over, and the trainer resumes from its checkpoints.
Exit code (the batch script's, so what sacct shows): 0 when the run completed, and also when the trainer checkpointed
cleanly on a time-limit or preemption signal (a continuation: the login side submits the next allocation, and sacct
must not list a planned time-limit chain as FAILED); 1 when the run stopped for any other reason.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

from moe_launch.conf.load import load_config
from moe_launch.conf.schema import ClusterConfig, HealthConfig, RootConfig
from moe_launch.errors import SubmissionError
from moe_launch.orchestrator.backend import Cluster, Step, free_port
from moe_launch.orchestrator.decide import decide
from moe_launch.orchestrator.events import (
    AllocationEnding,
    Event,
    Fault,
    Hang,
    LaunchTimeout,
    NodesLost,
    PreflightDone,
    Probed,
    StepExited,
    StopRequested,
    SuspectChecked,
)
from moe_launch.orchestrator.last_record import run_recorded
from moe_launch.orchestrator.local_cluster import LocalCluster
from moe_launch.orchestrator.plan import LaunchPlan, read_plan
from moe_launch.orchestrator.recovery import resume_details
from moe_launch.orchestrator.standby import StandbyPool, standby_mode
from moe_launch.orchestrator.state import Action, SupervisorState, apply, in_run_blame, replay
from moe_launch.orchestrator.step_log import trainer_message
from moe_launch.orchestrator.summary import build_summary, write_summary
from moe_launch.orchestrator.watch import Watcher
from moe_launch.rundir import (
    EXIT_CHECKPOINT,
    EXIT_CHECKPOINT_WRITE,
    EXIT_CONFIG,
    RunDir,
    journal_event,
    node_name,
    read_jsonl,
)

STOP_FILE = "STOP"
_ACTION_KIND = {"launch": "launch", "relaunch": "launch", "update": "info", "stop": "stop", "complete": "done"}
_SCHEDULER_POLL_S = 2.0
_PREEMPT_WAIT_S = 60.0  # time the trainer gets to checkpoint after USR2 before it is killed


def make_cluster(cfg: RootConfig, plan: LaunchPlan) -> Cluster:
    if plan.kind == "local":
        return LocalCluster(plan.local_nodes, plan.tasks_per_node)
    from moe_launch.orchestrator.slurm import SlurmCluster

    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise SystemExit("cluster.kind=slurm: the supervisor must run inside the allocation (SLURM_JOB_ID unset)")
    return SlurmCluster(job_id, cfg.cluster, cfg.supervisor.exit_grace_s)


def event_record(ev: Event) -> tuple[str, tuple[str, ...], dict[str, Any]]:
    """Journal kind, nodes and details of an observation."""
    d = {"event": type(ev).__name__, **asdict(ev)}
    d.pop("nodes", None)  # NodesLost.nodes: the record's own `nodes` field carries them
    if isinstance(ev, PreflightDone):
        return "preflight", ev.healthy, d
    if isinstance(ev, SuspectChecked):
        return "preflight", (ev.node,), d
    if isinstance(ev, Probed):
        return "preflight", tuple(ev.failed) or ev.healthy, d
    if isinstance(ev, Fault):
        return "fault", (ev.node,), d
    if isinstance(ev, StepExited):
        return ("info" if ev.code == 0 and not ev.dead_nodes else "failure"), ev.dead_nodes + ev.failed_nodes, d
    if isinstance(ev, Hang):
        return "failure", ev.suspects, d
    if isinstance(ev, NodesLost):
        return "failure", ev.nodes, d
    if isinstance(ev, LaunchTimeout):
        return "failure", (), d
    return "info", (), d


class Supervisor:
    def __init__(self, cfg: RootConfig, rd: RunDir, cluster: Optional[Cluster] = None):
        self.cfg, self.rd = cfg, rd
        self.plan = read_plan(rd.root)  # the login side's plan of this allocation: nodes, commands
        self.cluster = cluster or make_cluster(cfg, self.plan)
        self.watcher = Watcher(rd, cfg.supervisor.hang_timeout_s, cfg.supervisor.launch_timeout_s)
        self.step: Optional[Step] = None
        self.checked: queue.Queue[SuspectChecked] = queue.Queue()  # results of background re-checks
        self.lost_seen: set[str] = set()
        self.failure_t: Optional[float] = None  # when the failure that caused the running attempt was observed
        self.failed_at: Optional[float] = None  # that failure's last sign of progress: the last heartbeat
        self.stop_seen = False
        self.ending = threading.Event()  # set by SIGUSR2 (time limit / preemption warning)
        self.ending_seen = False
        self.forward_ending = False  # the warning waits for the trainer's first heartbeat, then goes to it
        self.trainer_argv = list(self.plan.trainer_argv)
        self.standbys = StandbyPool(self.cluster, rd, self.trainer_argv, standby_mode(cfg.supervisor))
        self.state: SupervisorState
        self.scheduler: SchedulerWatch  # started by run()

    # ---- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, lambda *_: self.ending.set())
        nodes = self.cluster.allocation()
        records = read_jsonl(self.rd.journal)
        prev = replay(records, self.cfg.cluster.nodes, self.cfg.supervisor.max_restarts)
        journal_event(self.rd, "allocation", nodes, job_id=os.environ.get("SLURM_JOB_ID", "local"),
                      supervisor_host=node_name(), supervisor_pid=os.getpid(),
                      carried_over=bool(prev), excluded=dict(prev.excluded) if prev else {})
        state = replay(read_jsonl(self.rd.journal), self.cfg.cluster.nodes, self.cfg.supervisor.max_restarts)
        assert state is not None
        self.state = state
        self.scheduler = SchedulerWatch(self)
        self.handle(self.preflight(self.state.buffers))
        while not self.state.finished:
            for ev in self.observe():
                self.handle(ev)
                if self.state.finished:
                    break
            else:
                time.sleep(self.cfg.supervisor.poll_s)
        return self.finish()

    def handle(self, ev: Event) -> None:
        action = decide(self.state, ev)
        if action.kind == "relaunch" and action.swaps:
            ev, action = self._probe_before_swap(ev, action)
        self._carry_out(ev, action)

    def _probe_before_swap(self, ev: Event, action: Action) -> tuple[Event, Action]:
        """Spares can die unseen: the scheduler notices a dead node only after its node timeout, and a dead spare
        swapped in costs a second failure (whose srun then reports the healthy peers as killed). So the nodes the
        relaunch would use, spares included, run a probe step first. Dead spares leave the pools; active nodes that
        do not answer either failed together with the first to report (they join its dead nodes) or are lost."""
        for _ in range(len(self.state.buffers) + 1):
            out = {o for o, _ in action.swaps}
            pool = tuple(n for n in dict.fromkeys(self.state.active + self.state.buffers) if n not in out)
            alive = self.cluster.probe(pool)
            dead = tuple(n for n in pool if n not in alive)
            if not dead:
                break
            spares = tuple(n for n in dead if n in self.state.buffers)
            if spares:
                lost = NodesLost(spares, detail="no answer to a probe step before the swap")
                self._carry_out(lost, decide(self.state, lost))
            peers = tuple(n for n in dead if n in self.state.active)
            if peers and isinstance(ev, StepExited):
                ev = replace(ev, dead_nodes=tuple(dict.fromkeys(ev.dead_nodes + peers)))
            action = decide(self.state, ev)
            if action.kind != "relaunch" or not action.swaps:
                break
        return ev, action

    def _carry_out(self, ev: Event, action: Action) -> None:
        if action.kind == "ignore":
            return
        kind, nodes, details = event_record(ev)
        journal_event(self.rd, kind, nodes, **details)
        self.state = apply(self.state, action)
        for out, new in action.swaps:
            journal_event(self.rd, "exclude" if out in action.exclude else "info", (out,),
                          reason=action.exclude.get(out, f"{out} set aside for a re-check"))
            journal_event(self.rd, "swap", (out, new), out=out, buffer_in=new)
        journal_event(self.rd, _ACTION_KIND[action.kind], self.state.active, action=action.to_json(),
                      reason=action.reason, attempt=self.state.attempt, restarts=self.state.restarts)
        self._record_blame(in_run_blame(action))
        self.act(action, ev)

    def _record_blame(self, blamed: dict[str, str]) -> None:
        """In-run blame joins the nodes' health history, so quarantine learns from it as from preflight."""
        if not blamed:
            return
        from moe_launch.health import store

        health = preflight_health_config(self.cfg.health, self.cfg.cluster, self.rd.health)
        try:
            store.record_in_run(store.cluster_dir(health, self.cfg.cluster.name), health, blamed, self.cfg.run.name)
        except OSError as e:  # the history is advice; the run goes on without it
            journal_event(self.rd, "info", tuple(blamed), message=f"health history not updated: {e}")

    def act(self, action: Action, ev: Event) -> None:
        if action.kind in ("launch", "relaunch"):
            self.failure_t = time.time() if action.kind == "relaunch" else None
            self.failed_at = self.watcher.last_beat  # before _launch starts watching the new attempt
            self._end_step(graceful=False)
            self._launch()
            if action.recheck:  # in the background: the new attempt must be watched meanwhile
                threading.Thread(target=self._recheck_all, args=(action.recheck,), daemon=True).start()
        elif isinstance(ev, AllocationEnding) and action.kind == "update":
            self.forward_ending = True
        elif action.kind == "stop":
            self._end_step(graceful=self.state.status in ("preempted", "stopped"))
        elif action.probe:  # a hang nobody is blamed for: the hung step goes, its nodes are checked, decide() again
            self._end_step(graceful=False)
            done = self.preflight(action.probe)
            self.checked.put(Probed(attempt=self.state.attempt, step=self.watcher.step, healthy=done.healthy,
                                    failed=done.failed,
                                    detail="" if self.cfg.health.preflight else "not probed: health.preflight=false"))

    def observe(self) -> list[Event]:
        events: list[Event] = []
        while not self.checked.empty():
            events.append(self.checked.get())
        now = time.time()
        if not self.stop_seen and (self.rd.root / STOP_FILE).exists():
            self.stop_seen = True
            events.append(StopRequested())
        if self.ending.is_set() and not self.ending_seen:
            self.ending_seen = True
            events.append(AllocationEnding())
        if self.forward_ending and self.step is not None and self.watcher.first_beat is not None:
            # only now: a trainer still starting may have no handler yet (USR2 would kill it unsaved), and stopping
            # it before its first step would make no progress in this allocation
            self.forward_ending = False
            self.step.terminate("USR2")
        events += self.watcher.poll(now)
        if self.state.phase == "running":
            self.standbys.sync(self.state.active, self.state.buffers, training=self.watcher.first_beat is not None)
        self._note_resume()
        if self.step is not None:
            result = self.step.poll()
            if result is not None:
                step, self.step = self.step, None
                events += self.watcher.faults()  # a fault record explains the exit better than the exit code
                # the trainer prints why it refuses (bad config or data, no usable checkpoint) as its last line
                said = (trainer_message(self.rd.logs / f"attempt{step.attempt}")
                        if result.code in (EXIT_CONFIG, EXIT_CHECKPOINT) else "")
                detail = f"{result.detail}; the trainer said: {said}" if said else result.detail
                if result.code == EXIT_CHECKPOINT_WRITE:  # the cause and the path are all a reader needs
                    detail = _storage_error(read_jsonl(self.rd.journal)) or detail
                events.append(StepExited(attempt=step.attempt, code=result.code, dead_nodes=result.dead_nodes,
                                         failed_nodes=result.failed_nodes, step=self.watcher.step, detail=detail))
        lost = {n: s for n, s in self.scheduler.unavailable.items() if n not in self.lost_seen}
        if lost:
            self.lost_seen |= set(lost)
            events.append(NodesLost(tuple(sorted(lost)), detail=", ".join(f"{n}: {s}" for n, s in lost.items())))
        return events

    def finish(self) -> int:
        self.scheduler.stop()
        self.standbys.stop()
        self._end_step(graceful=False)
        records = read_jsonl(self.rd.journal)
        wall = time.time() - (records[0]["time"] if records else time.time())
        if self.state.status != "preempted":  # preempted: the login side resubmits; the run is not over
            write_summary(self.rd, build_summary(self.rd, self.state, wall, resubmits=_resubmits(records)))
        return 0 if self.state.status in ("completed", "preempted") else 1

    # ---- side effects -------------------------------------------------------------------------------------------
    def _launch(self) -> None:
        attempt = self.state.attempt
        env = {"MASTER_PORT": str(free_port()), "MOE_LAUNCH_ATTEMPT": str(attempt)}
        argv = self.trainer_argv + ["--attempt", str(attempt)]
        self.watcher.start_attempt(attempt, time.time())
        self.step = self.cluster.launch(self.state.active, attempt, argv, env, self.rd.logs / f"attempt{attempt}")

    def _end_step(self, graceful: bool) -> None:
        step, self.step = self.step, None
        if step is None:
            return
        if graceful:
            deadline = time.time() + _PREEMPT_WAIT_S
            # a trainer still starting may not have its signal handler (USR2 would kill it, unsaved), and stopping
            # it before its first step would make no progress in this allocation: wait for its first heartbeat
            while self.watcher.first_beat is None and step.poll() is None and time.time() < deadline:
                self.watcher.poll(time.time())
                time.sleep(0.2)
            step.terminate("USR2")  # the trainer checkpoints and exits 4
            while time.time() < deadline and step.poll() is None:
                time.sleep(0.2)
        step.kill()

    def _note_resume(self) -> None:
        beat = self.watcher.first_beat
        if beat is None or self.failure_t is None:
            return
        journal_event(self.rd, "resume", self.state.active, attempt=self.state.attempt, step=beat.get("step"),
                      **resume_details(self.rd.heartbeat, self.state.attempt, self.failed_at, self.failure_t,
                                       beat["time"]))
        self.failure_t = None

    def preflight(self, nodes: tuple[str, ...]) -> PreflightDone:
        result = self._run_preflight(nodes)
        if result is None:
            return PreflightDone(healthy=nodes)
        failed = {n: "; ".join(r) if isinstance(r, (list, tuple)) else str(r) for n, r in result.failed.items()}
        return PreflightDone(healthy=tuple(n for n in nodes if n in set(result.healthy)), failed=failed)

    def _recheck_all(self, nodes: tuple[str, ...]) -> None:
        for node in nodes:
            try:
                self.checked.put(self.recheck(node))
            except Exception as e:  # noqa: BLE001 — a crashed check must not clear the node, nor kill the loop
                self.checked.put(SuspectChecked(node, healthy=False, detail=f"re-check crashed: {e!r}"))

    def recheck(self, node: str) -> SuspectChecked:
        result = self._run_preflight((node,))
        if result is None:  # without a check we cannot clear it: it stays out of the job
            return SuspectChecked(node, healthy=False, detail="no preflight to clear it (health.preflight=false)")
        why = result.failed.get(node)
        return SuspectChecked(node, healthy=node in result.healthy, detail="; ".join(why) if why else "")

    def _run_preflight(self, nodes: tuple[str, ...]) -> Any:
        if not self.cfg.health.preflight:
            journal_event(self.rd, "info", nodes, message="preflight skipped (health.preflight=false)")
            return None
        from moe_launch.health.preflight import run_preflight

        health = preflight_health_config(self.cfg.health, self.cfg.cluster, self.rd.health)
        # local "nodes" share this machine's cores: their all-to-all bandwidth says nothing about them
        return run_preflight(list(nodes), health, self.cfg.cluster, self.rd.health, self.cfg.run.name,
                             judge_bandwidth=self.cfg.cluster.kind != "local")


def preflight_health_config(health: HealthConfig, cluster: ClusterConfig, run_health_dir: Path) -> HealthConfig:
    """cluster=local: the "nodes" are process groups sharing this machine's cores, so a bandwidth baseline recorded
    under another day's load says nothing about them, and quarantining "local2" across runs is meaningless. Unless
    the user chose paths, such a run keeps its baseline and health history in its own run directory: its first
    preflight records the baseline that re-checks of suspect nodes within the run are compared with."""
    if cluster.kind != "local":
        return health
    defaults = HealthConfig()
    a2a = health.alltoall
    if a2a.baseline_path == defaults.alltoall.baseline_path:
        a2a = replace(a2a, baseline_path=str(run_health_dir / "a2a_baselines.json"))
    store_dir = str(run_health_dir / "store") if health.store_dir == defaults.store_dir else health.store_dir
    return replace(health, alltoall=a2a, store_dir=store_dir)


class SchedulerWatch:
    """Asks the scheduler about the nodes every few seconds, in a thread: slurmctld can take many seconds to answer
    while it is trying to reach a dead node, and the supervisor's loop must keep reading srun's stderr meanwhile."""

    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.unavailable: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="scheduler-watch")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(_SCHEDULER_POLL_S):
            st = self.sup.state  # an immutable snapshot
            try:
                self.unavailable = self.sup.cluster.unavailable(st.active + st.buffers + st.suspects)
            except SubmissionError as e:  # a slurmctld hiccup must not end the run; the step is still watched
                journal_event(self.sup.rd, "info", (), message=f"scheduler query failed, retrying: {e}")

    def stop(self) -> None:
        self._stop.set()


def _storage_error(records: list[dict[str, Any]]) -> str:
    """The trainer's own account of a checkpoint write that kept failing (its journal stop record names the error
    and the path), or ''."""
    for r in reversed(records):
        if r.get("kind") == "stop" and r["details"].get("reason") == "checkpoint_write":
            return str(r["details"].get("what", ""))
    return ""


def _resubmits(records: list[dict[str, Any]]) -> int:
    return sum(1 for r in records if r.get("kind") == "resubmit")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_launch.orchestrator.supervisor",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    args = ap.parse_args(argv)
    rd = RunDir(args.run_dir.absolute()).make()
    cfg = load_config(rd.config)
    return run_recorded(Supervisor(cfg, rd))  # SIGTERM and a full disk still leave a record


if __name__ == "__main__":
    sys.exit(main())
