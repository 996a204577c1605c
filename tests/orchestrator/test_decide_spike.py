"""decide() on the trainer's spike exits: a rollback relaunches on the same nodes (no node is blamed, it counts as a
restart, and repeated rollbacks are not mistaken for a repeating failure); an unrecoverable spike stops."""

from __future__ import annotations

from moe_launch.orchestrator.decide import decide
from moe_launch.orchestrator.events import PreflightDone, StepExited
from moe_launch.orchestrator.state import apply, initial_state
from moe_launch.rundir import EXIT_ROLLBACK, EXIT_SPIKE


def _launched(max_restarts=5):
    nodes = ("node1", "node2", "node3")
    s = initial_state(2, max_restarts, list(nodes))
    return apply(s, decide(s, PreflightDone(healthy=nodes)))


def test_rollback_relaunches_on_the_same_nodes_until_restarts_run_out():
    s = _launched(max_restarts=2)
    active = s.active
    for attempt in (0, 1):
        a = decide(s, StepExited(attempt=attempt, code=EXIT_ROLLBACK, step=10))
        assert a.kind == "relaunch" and a.nodes == active and not a.exclude and "spike" in a.reason
        s = apply(s, a)
    a = decide(s, StepExited(attempt=2, code=EXIT_ROLLBACK, step=10))
    assert a.kind == "stop" and "max_restarts" in a.reason


def test_unrecoverable_spike_stops_as_a_data_or_model_problem():
    s = _launched()
    a = decide(s, StepExited(attempt=0, code=EXIT_SPIKE, step=10, detail="recurs after the rollback"))
    assert a.kind == "stop" and a.status == "failed" and "not a node problem" in a.reason
