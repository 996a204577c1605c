"""The supervisor's state, the actions that change it, and its reconstruction from journal.jsonl.

`decide(state, event) -> Action` (decide.py) chooses; `apply(state, action) -> state` (here) folds the action in.
Both are pure. The supervisor journals every action it applies (`details["action"]`), so folding the journal's
actions over the initial state rebuilds the supervisor's state exactly: that is what `attach`, `status`, the
post-mortem and a resubmitted supervisor use.

Node pools are disjoint: `active` (the trainer runs there, in rank order, the first node hosts MASTER_ADDR),
`buffers` (healthy spares), `suspects` (set aside after a soft fault or a hang, waiting for a preflight re-check),
`excluded` (never used again in this run: hard failure, failed check).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Optional

PHASES = ("preflight", "running", "stopped", "completed")
ACTION_KINDS = ("launch", "relaunch", "update", "stop", "complete", "ignore")


@dataclass(frozen=True)
class Action:
    """One decision. `nodes`/`buffers`/`suspects` are the complete new pools when set (None: unchanged)."""

    kind: str
    reason: str = ""
    nodes: Optional[tuple[str, ...]] = None
    buffers: Optional[tuple[str, ...]] = None
    suspects: Optional[tuple[str, ...]] = None
    exclude: dict[str, str] = field(default_factory=dict)  # node -> why, added to `excluded`
    swaps: tuple[tuple[str, str], ...] = ()  # (node out, buffer in)
    recheck: tuple[str, ...] = ()  # nodes to re-run preflight on
    probe: tuple[str, ...] = ()  # nodes to probe now, before deciding on a relaunch (the step is ended first)
    fault: Optional[tuple[int, str, str]] = None  # (step, node, what) remembered for the determinism check
    failure: Optional[tuple[int, int]] = None  # (code, step) of a failure without a node cause
    status: str = ""  # for stop: failed | preempted | stopped

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; known: {ACTION_KINDS}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Action":
        tup = lambda v: None if v is None else tuple(v)  # noqa: E731
        return Action(
            kind=d["kind"],
            reason=d.get("reason", ""),
            nodes=tup(d.get("nodes")),
            buffers=tup(d.get("buffers")),
            suspects=tup(d.get("suspects")),
            exclude=dict(d.get("exclude") or {}),
            swaps=tuple(tuple(s) for s in d.get("swaps") or ()),
            recheck=tuple(d.get("recheck") or ()),
            probe=tuple(d.get("probe") or ()),
            fault=None if d.get("fault") is None else tuple(d["fault"]),
            failure=None if d.get("failure") is None else tuple(d["failure"]),
            status=d.get("status", ""),
        )


@dataclass(frozen=True)
class SupervisorState:
    want: int  # N: nodes the trainer needs
    max_restarts: int
    active: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    suspects: tuple[str, ...] = ()
    excluded: dict[str, str] = field(default_factory=dict)
    attempt: int = -1  # trainer attempt now running (0 = first launch); -1 before the first launch
    restarts: int = 0
    swapped: tuple[tuple[str, str], ...] = ()
    faults: tuple[tuple[int, str, str], ...] = ()  # (step, node, what)
    last_failure: Optional[tuple[int, int]] = None  # (code, step) of the last failure without a node cause
    phase: str = "preflight"
    status: str = ""  # final: completed | failed | preempted | stopped
    reason: str = ""

    @property
    def finished(self) -> bool:
        return self.phase in ("stopped", "completed")


def initial_state(want: int, max_restarts: int, nodes: Iterable[str], excluded: Optional[dict[str, str]] = None,
                  restarts: int = 0, attempt: int = -1, swapped: Iterable[tuple[str, str]] = ()) -> SupervisorState:
    """Before preflight: every allocated node is a buffer candidate. A resubmitted allocation carries the earlier
    allocations' exclusions, restart count and attempt number forward (attempts keep growing across allocations)."""
    excluded = dict(excluded or {})
    pool = tuple(n for n in nodes if n not in excluded)
    return SupervisorState(want=want, max_restarts=max_restarts, buffers=pool, excluded=excluded, restarts=restarts,
                           attempt=attempt, swapped=tuple(tuple(s) for s in swapped))


def apply(state: SupervisorState, action: Action) -> SupervisorState:
    if action.kind == "ignore":
        return state
    s = replace(
        state,
        active=state.active if action.nodes is None else action.nodes,
        buffers=state.buffers if action.buffers is None else action.buffers,
        suspects=state.suspects if action.suspects is None else action.suspects,
        excluded={**state.excluded, **action.exclude},
        swapped=state.swapped + tuple(action.swaps),
        faults=state.faults + ((action.fault,) if action.fault else ()),
        last_failure=action.failure if action.kind == "relaunch" else state.last_failure,
    )
    if action.kind == "launch":
        return replace(s, attempt=state.attempt + 1, phase="running", last_failure=None)
    if action.kind == "relaunch":
        return replace(s, attempt=state.attempt + 1, restarts=state.restarts + 1, phase="running")
    if action.kind == "stop":
        return replace(s, phase="stopped", status=action.status or "failed", reason=action.reason)
    if action.kind == "complete":
        return replace(s, phase="completed", status="completed", reason=action.reason)
    return s  # update


# exclusions that only record a failed check: a new start checks those nodes again instead of inheriting them
CHECK_EXCLUSIONS = ("preflight failed", "failed re-check")
NEW_START = "new_start"  # detail of the journal record a start of an existing run writes before its allocation


def in_run_blame(action: Action) -> dict[str, str]:
    """Pure: nodes an action takes out of the job for what happened during training (node -> why): excluded for a
    node failure, a hang or a failed probe, or set aside as suspects after a fault. Exclusions for a failed check are
    left out: the check recorded them itself."""
    blamed = {n: why for n, why in action.exclude.items() if not why.startswith(CHECK_EXCLUSIONS)}
    for out, _ in action.swaps:
        blamed.setdefault(out, f"set aside: {action.reason}")
    return blamed


def carried_exclusions(excluded: dict[str, str], new_start: bool) -> dict[str, str]:
    """Pure: what the next allocation inherits. A resubmission keeps every exclusion; a new start by the user keeps
    the hard failures (node lost, faults) and re-checks nodes that only failed a check."""
    return {n: why for n, why in excluded.items() if not (new_start and why.startswith(CHECK_EXCLUSIONS))}


def replay(records: Iterable[dict[str, Any]], want: int, max_restarts: int) -> Optional[SupervisorState]:
    """Rebuild the state from journal records. The latest `allocation` record starts a (resubmitted) supervisor's
    state; actions after it fold in. A NEW_START record (the user ran moe-launch again) before an allocation makes it
    a new start: check exclusions are dropped and the restart budget is fresh. None if no allocation was journaled
    yet."""
    state: Optional[SupervisorState] = None
    new_start = False
    for rec in records:
        d = rec.get("details") or {}
        if d.get(NEW_START):
            new_start = state is not None
        elif rec.get("kind") == "allocation" and "nodes" in rec:
            prev = state
            state = initial_state(
                want, max_restarts, rec["nodes"],
                excluded=carried_exclusions(prev.excluded, new_start) if prev else d.get("excluded"),
                restarts=prev.restarts if prev and not new_start else 0,
                attempt=prev.attempt if prev else -1,
                swapped=prev.swapped if prev else (),
            )
            if prev:
                state = replace(state, faults=prev.faults)
            new_start = False
        elif state is not None and isinstance(d.get("action"), dict):
            state = apply(state, Action.from_json(d["action"]))
    return state
