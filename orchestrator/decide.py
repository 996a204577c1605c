"""The supervisor's decisions: pure `decide(state, event) -> Action`.

Policy, in the order a reader asks about it:
- a node that died (node failure, tasks killed, gone from the allocation) is excluded for the rest of the run and a
  buffer node takes its place, at the same position so the rank layout is stable; the trainer relaunches and resumes
  from the newer valid checkpoint (the trainer picks it);
- a node whose rank reported NaN/Inf, or whose ranks stopped first in a hang, becomes a *suspect*: it leaves the job,
  a buffer takes its place, and preflight re-runs on it; healthy -> it becomes a buffer again, not -> excluded;
- the same fault (same what, same step) recurring on a different node is not a node problem: the model or data
  produce it deterministically, swapping cannot help, stop with that diagnosis;
- a failure without a node cause is retried once on the same nodes; the same exit at the same step again -> stop;
- exit codes of the trainer (moe_launch.rundir): 0 done, 2 config (stop), 4 preempted (stop, the login side
  resubmits), 5 checkpoint (stop), 6 spike rollback (relaunch on the same nodes: no node is to blame; the trainer
  restarts from the model checkpoint it chose), 7 spike it cannot roll back from or that recurred (stop), 8 checkpoint
  storage failed (stop: a full or read-only file system is no node's fault, and a relaunch would only fail again);
- every relaunch counts against supervisor.max_restarts; too few buffers -> stop, naming what was lost.
"""

from __future__ import annotations

from dataclasses import replace

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
from moe_launch.orchestrator.state import Action, SupervisorState
from moe_launch.rundir import (
    EXIT_CHECKPOINT,
    EXIT_CHECKPOINT_WRITE,
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_ROLLBACK,
    EXIT_SPIKE,
)

IGNORE = Action(kind="ignore")


def decide(state: SupervisorState, event: Event) -> Action:
    if state.finished:
        return IGNORE
    if isinstance(event, StopRequested):
        return Action(kind="stop", status="stopped", reason=event.reason)
    if isinstance(event, AllocationEnding):
        if state.phase == "running":  # the trainer's exit says how it ended: 4 checkpointed, 0 finished anyway
            return Action(kind="update", reason=f"{event.reason}: passed on to the trainer, which checkpoints")
        return Action(kind="stop", status="preempted",
                      reason=f"{event.reason} before the trainer ran; the login side continues in a new allocation")
    if isinstance(event, PreflightDone):
        return _initial_launch(state, event)
    if isinstance(event, SuspectChecked):
        return _suspect_checked(state, event)
    if isinstance(event, NodesLost):
        return _nodes_lost(state, event)
    if state.phase != "running" or getattr(event, "attempt", state.attempt) != state.attempt:
        return IGNORE  # an observation about an attempt that was already replaced
    if isinstance(event, Fault):
        return _fault(state, event)
    if isinstance(event, Hang):
        return _hang(state, event)
    if isinstance(event, Probed):
        return _probed(state, event)
    if isinstance(event, LaunchTimeout):
        return _restart_same(state, "no heartbeat within supervisor.launch_timeout_s of the launch", None)
    if isinstance(event, StepExited):
        return _step_exited(state, event)
    raise TypeError(f"unknown event {event!r}")


def _initial_launch(state: SupervisorState, ev: PreflightDone) -> Action:
    if state.phase != "preflight":
        return IGNORE
    failed = {n: f"preflight failed: {why}" for n, why in ev.failed.items() if n not in state.excluded}
    healthy = tuple(n for n in state.buffers if n in ev.healthy and n not in failed)
    if len(healthy) < state.want:
        return Action(
            kind="stop", status="failed", exclude=failed, buffers=healthy,
            reason=f"only {len(healthy)} healthy node(s) for cluster.nodes={state.want} "
                   f"(failed preflight: {_names(failed) or 'none'}); allocate more cluster.buffers or fix the nodes",
        )
    note = f", failed: {_names(failed)}" if failed else ""
    return Action(kind="launch", nodes=healthy[: state.want], buffers=healthy[state.want:], exclude=failed,
                  reason=f"preflight passed on {len(healthy)} node(s){note}")


def _swap_out(state: SupervisorState, out: tuple[str, ...], why: str, *, exclude: bool,
              fault=None, failure=None) -> Action:
    """Replace `out` (active nodes) with buffers and relaunch; `out` is excluded or set aside as suspects. When the
    run must stop instead, `out` still leaves the job, so the record (and a resubmission) never reuses it."""
    out = tuple(n for n in state.active if n in out)
    gone = {"exclude": {n: why for n in out} if exclude else {},
            "suspects": state.suspects if exclude else state.suspects + out}
    remaining = tuple(n for n in state.active if n not in out)
    buffers = list(state.buffers)
    if len(buffers) < len(out):
        return Action(
            kind="stop", status="failed", nodes=remaining, fault=fault, **gone,
            reason=f"buffers exhausted: lost {_names(out)} ({why}) with {len(buffers)} buffer(s) left; "
                   f"the run stops and keeps its checkpoints — resubmit with more cluster.buffers to resume",
        )
    if state.restarts >= state.max_restarts:
        return replace(_max_restarts(state, why, fault), nodes=remaining, **gone)
    swaps = tuple((n, buffers.pop(0)) for n in out)
    swap_in = dict(swaps)
    nodes = tuple(swap_in.get(n, n) for n in state.active)
    return Action(
        kind="relaunch", nodes=nodes, buffers=tuple(buffers), swaps=swaps, fault=fault, failure=failure,
        recheck=() if exclude else out, **gone,
        reason=f"{why}: " + ", ".join(f"{a} -> {b}" for a, b in swaps) + "; resume from the newer checkpoint",
    )


def _restart_same(state: SupervisorState, why: str, failure) -> Action:
    if state.restarts >= state.max_restarts:
        return _max_restarts(state, why, None)
    return Action(kind="relaunch", nodes=state.active, failure=failure,
                  reason=f"{why}; relaunch on the same nodes, resume from the newer checkpoint")


def _max_restarts(state: SupervisorState, why: str, fault) -> Action:
    return Action(kind="stop", status="failed", fault=fault,
                  reason=f"{why}, but supervisor.max_restarts={state.max_restarts} restarts are used up; "
                         f"raise supervisor.max_restarts and resubmit to resume from the last checkpoint")


def _fault(state: SupervisorState, ev: Fault) -> Action:
    fault = (ev.step, ev.node, ev.what)
    for step, node, what in state.faults:
        if step == ev.step and what == ev.what and node != ev.node:
            return Action(
                kind="stop", status="failed", fault=fault,
                reason=f"deterministic model fault: {ev.what} at step {ev.step} on {node} and again on {ev.node} — "
                       f"the same fault on different nodes is not a node problem; swapping cannot fix it. Check "
                       f"train.lr, the data around step {ev.step}, or resume from an earlier model checkpoint",
            )
    if ev.node not in state.active:
        return _restart_same(state, f"{ev.what} at step {ev.step} on rank {ev.rank} (host {ev.node}, not in the job)",
                             (-1, ev.step))
    return _swap_out(state, (ev.node,), f"{ev.what} at step {ev.step} on rank {ev.rank} ({ev.node})",
                     exclude=False, fault=fault)


def _hang(state: SupervisorState, ev: Hang) -> Action:
    suspects = tuple(n for n in state.active if n in ev.suspects)
    why = f"hang: no progress for {ev.idle_s:.0f} s after step {ev.step}"
    if not suspects or len(suspects) == len(state.active):
        if state.restarts >= state.max_restarts:
            return _restart_same(state, why + " (no single node to blame)", (-2, ev.step))
        # every rank stopped together (a collective): find the node before relaunching on the same ones
        return Action(kind="update", probe=state.active,
                      reason=why + " with no single node to blame: probing the job's nodes (compute check, "
                                   "all-to-all with isolation) before a relaunch")
    return _swap_out(state, suspects, why + f" on {_names(suspects)}", exclude=False)


def _probed(state: SupervisorState, ev: Probed) -> Action:
    why = f"hang after step {ev.step}"
    bad = tuple(n for n in state.active if n in ev.failed)
    if not bad:
        passed = f" ({ev.detail})" if ev.detail else ": every node passed the probe"
        return _restart_same(state, why + passed + " (no node to blame)", (-2, ev.step))
    found = "; ".join(f"{n}: {ev.failed[n]}" for n in bad)
    return _swap_out(state, bad, f"{why}, probe failed on {found}", exclude=True)


def _step_exited(state: SupervisorState, ev: StepExited) -> Action:
    if ev.code == EXIT_OK and not ev.dead_nodes:
        return Action(kind="complete", reason="trainer finished")
    if ev.dead_nodes:
        return _swap_out(state, ev.dead_nodes, f"node failure ({ev.detail or f'exit {ev.code}'})", exclude=True)
    if ev.code == EXIT_CONFIG:
        return Action(kind="stop", status="failed",
                      reason=f"trainer exit {ev.code}: bad config or data, relaunching cannot help ({ev.detail})")
    if ev.code == EXIT_PREEMPTED:
        return Action(kind="stop", status="preempted",
                      reason="trainer checkpointed and exited on a preemption/time-limit signal; resubmit to continue")
    if ev.code == EXIT_ROLLBACK:
        why = f"training spike at step {ev.step}, rolling back ({ev.detail or 'see the spike record in the journal'})"
        return _restart_same(state, why, None)
    if ev.code == EXIT_SPIKE:
        return Action(kind="stop", status="failed",
                      reason=f"trainer exit {ev.code}: training spike that is a data/model problem, not a node "
                             f"problem ({ev.detail or 'see the spike records in the journal'})")
    if ev.code == EXIT_CHECKPOINT:
        return Action(kind="stop", status="failed",
                      reason=f"trainer exit {ev.code}: no usable checkpoint ({ev.detail}); see logs/")
    if ev.code == EXIT_CHECKPOINT_WRITE:
        return Action(kind="stop", status="failed",
                      reason=f"checkpoint storage failed: {ev.detail or 'see logs/'}; once it is fixed, "
                             f"moe-launch with the same run.name resumes from the newest valid checkpoint")
    failure = (ev.code, ev.step)
    if state.last_failure == failure:
        return Action(kind="stop", status="failed", failure=failure,
                      reason=f"same failure repeating without a node cause: exit {ev.code} at step {ev.step} twice "
                             f"({ev.detail}); see logs/ for the traceback")
    return _restart_same(state, f"trainer exit {ev.code} at step {ev.step} ({ev.detail or 'no node cause'})", failure)


def _nodes_lost(state: SupervisorState, ev: NodesLost) -> Action:
    lost = set(ev.nodes) - set(state.excluded)
    if not lost:
        return IGNORE
    why = f"node lost ({ev.detail or 'left the allocation'})"
    spare_lost = {n: why for n in lost if n not in state.active}
    if state.phase == "running" and lost & set(state.active):
        act = _swap_out(state, tuple(lost & set(state.active)), why, exclude=True)
        return _also_drop(act, state, spare_lost)
    return _also_drop(Action(kind="update", reason=why + f": {_names(lost)}"), state, spare_lost)


def _also_drop(act: Action, state: SupervisorState, spare_lost: dict[str, str]) -> Action:
    """Remove lost spares (buffers, suspects) from the pools an action leaves behind."""
    if not spare_lost:
        return act
    buffers = act.buffers if act.buffers is not None else state.buffers
    suspects = act.suspects if act.suspects is not None else state.suspects
    return Action(**{**act.__dict__, "buffers": tuple(n for n in buffers if n not in spare_lost),
                     "suspects": tuple(n for n in suspects if n not in spare_lost),
                     "exclude": {**act.exclude, **spare_lost}})


def _suspect_checked(state: SupervisorState, ev: SuspectChecked) -> Action:
    if ev.node not in state.suspects:
        return IGNORE
    suspects = tuple(n for n in state.suspects if n != ev.node)
    if ev.healthy:
        return Action(kind="update", suspects=suspects, buffers=state.buffers + (ev.node,),
                      reason=f"{ev.node} passed the re-check and is a buffer again")
    return Action(kind="update", suspects=suspects, exclude={ev.node: f"failed re-check: {ev.detail}"},
                  reason=f"{ev.node} failed the re-check ({ev.detail}) and is excluded")


def _names(nodes) -> str:
    return ", ".join(sorted(nodes))
