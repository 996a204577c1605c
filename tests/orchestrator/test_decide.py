"""Pure tests of decide()/apply(): every policy branch, journal replay, and a simulated 1,024-node allocation."""

from __future__ import annotations

import random
import time

from moe_launch.orchestrator.decide import decide
from moe_launch.orchestrator.events import (
    AllocationEnding,
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
from moe_launch.orchestrator.state import Action, apply, initial_state, replay
from moe_launch.rundir import (
    EXIT_CHECKPOINT,
    EXIT_CHECKPOINT_WRITE,
    EXIT_CONFIG,
    EXIT_PREEMPTED,
    journal_event,
    read_jsonl,
)


def step(state, event):
    action = decide(state, event)
    return apply(state, action), action


def launched(n=2, b=2, max_restarts=5):
    nodes = [f"node{i}" for i in range(1, n + b + 1)]
    s, a = step(initial_state(n, max_restarts, nodes), PreflightDone(healthy=tuple(nodes)))
    assert a.kind == "launch" and s.attempt == 0
    return s


def check_pools(s, all_nodes):
    pools = [set(s.active), set(s.buffers), set(s.suspects), set(s.excluded)]
    assert sum(len(p) for p in pools) == len(set().union(*pools)), "pools overlap"
    assert set().union(*pools) == set(all_nodes)
    assert len(s.active) == len(set(s.active))


def test_preflight_picks_healthy_and_keeps_rest_as_buffers():
    s = initial_state(2, 5, ["a", "b", "c", "d"])
    s, a = step(s, PreflightDone(healthy=("a", "c", "d"), failed={"b": "dcgm fail"}))
    assert a.kind == "launch"
    assert s.active == ("a", "c") and s.buffers == ("d",) and "b" in s.excluded and s.phase == "running"


def test_preflight_too_few_healthy_stops_naming_nodes():
    s = initial_state(3, 5, ["a", "b", "c", "d"])
    s, a = step(s, PreflightDone(healthy=("a", "b"), failed={"c": "x", "d": "y"}))
    assert a.kind == "stop" and s.status == "failed"
    assert "c, d" in a.reason and "cluster.buffers" in a.reason


def test_hard_failure_excludes_and_swaps_in_place():
    s = launched()
    s, a = step(s, StepExited(attempt=0, code=1, dead_nodes=("node1",), detail="Node failure on node1"))
    assert a.kind == "relaunch" and a.swaps == (("node1", "node3"),)
    assert s.active == ("node3", "node2") and s.buffers == ("node4",) and "node1" in s.excluded
    assert s.attempt == 1 and s.restarts == 1 and s.swapped == (("node1", "node3"),)


def test_stale_events_of_replaced_attempt_are_ignored():
    s = launched()
    s, _ = step(s, StepExited(attempt=0, code=1, dead_nodes=("node2",)))
    for ev in (StepExited(attempt=0, code=1), Fault(0, "node1", 0, 3, "nan"), Hang(0, ("node1",), 3, 99.0)):
        assert decide(s, ev).kind == "ignore"


def test_soft_fault_sets_node_aside_then_recheck_returns_it_as_buffer():
    s = launched()
    s, a = step(s, Fault(attempt=0, node="node2", rank=1, step=7, what="nan loss"))
    assert a.kind == "relaunch" and a.recheck == ("node2",)
    assert s.suspects == ("node2",) and s.active == ("node1", "node3") and "node2" not in s.excluded
    s, a = step(s, SuspectChecked("node2", healthy=True))
    assert a.kind == "update" and s.buffers == ("node4", "node2") and s.suspects == ()
    s, a = step(s, Fault(attempt=1, node="node3", rank=1, step=12, what="nan loss"))
    s, a = step(s, SuspectChecked("node3", healthy=False, detail="gemm wrong result"))
    assert "node3" in s.excluded and s.suspects == ()


def test_same_fault_same_step_other_node_is_deterministic_stop():
    s = launched()
    s, _ = step(s, Fault(attempt=0, node="node1", rank=0, step=5, what="nan loss"))
    s, a = step(s, Fault(attempt=1, node="node2", rank=1, step=5, what="nan loss"))
    assert a.kind == "stop" and s.status == "failed"
    assert "deterministic model fault" in a.reason and "node1" in a.reason and "node2" in a.reason


def test_buffers_exhausted_stops_with_explanation():
    s = launched(n=2, b=1)
    s, _ = step(s, StepExited(attempt=0, code=1, dead_nodes=("node1",)))
    s, a = step(s, StepExited(attempt=1, code=1, dead_nodes=("node2",)))
    assert a.kind == "stop" and "buffers exhausted" in a.reason and "cluster.buffers" in a.reason
    assert set(s.excluded) == {"node1", "node2"}


def test_max_restarts_stops():
    s = launched(n=1, b=3, max_restarts=1)
    s, a = step(s, StepExited(attempt=0, code=1, dead_nodes=("node1",)))
    assert a.kind == "relaunch"
    s, a = step(s, StepExited(attempt=1, code=1, dead_nodes=("node2",)))
    assert a.kind == "stop" and "max_restarts" in a.reason


def test_exit_codes():
    s = launched()
    assert decide(s, StepExited(attempt=0, code=0)).kind == "complete"
    assert decide(s, StepExited(attempt=0, code=EXIT_CONFIG)).kind == "stop"
    a = decide(s, StepExited(attempt=0, code=EXIT_PREEMPTED))
    assert a.kind == "stop" and a.status == "preempted"
    assert decide(s, StepExited(attempt=0, code=EXIT_CHECKPOINT)).kind == "stop"


def test_checkpoint_storage_failure_stops_without_relaunch_naming_the_cause():
    s = launched()
    why = "checkpoint write failed: [Errno 30] Read-only file system: '/runs/x/checkpoints/.ckpt-b.tmp/model'"
    a = decide(s, StepExited(attempt=0, code=EXIT_CHECKPOINT_WRITE, step=6, detail=why))
    assert a.kind == "stop" and a.status == "failed" and a.nodes is None and not a.exclude  # no node is blamed
    assert "checkpoint storage failed" in a.reason and "Read-only file system" in a.reason and "/runs/x" in a.reason


def test_time_limit_warning_goes_to_the_trainer_whose_exit_decides():
    s = launched()
    a = decide(s, AllocationEnding())
    assert a.kind == "update" and not a.status  # the run goes on until the trainer exits
    assert decide(s, StepExited(attempt=0, code=EXIT_PREEMPTED)).status == "preempted"  # checkpointed: continue
    assert decide(s, StepExited(attempt=0, code=0)).kind == "complete"  # it reached the last step meanwhile
    before = initial_state(2, 5, ["node1", "node2"])  # still in preflight: nothing to save
    a = decide(before, AllocationEnding())
    assert a.kind == "stop" and a.status == "preempted"


def test_two_nodes_failing_together_are_both_excluded():
    s = launched(n=2, b=2)
    s, a = step(s, StepExited(attempt=0, code=137, dead_nodes=("node1", "node2")))
    assert a.kind == "relaunch" and a.swaps == (("node1", "node3"), ("node2", "node4"))
    assert set(s.excluded) == {"node1", "node2"} and s.active == ("node3", "node4")


def test_failure_without_node_cause_retried_once_then_stops():
    s = launched()
    s, a = step(s, StepExited(attempt=0, code=1, step=9, detail="Traceback"))
    assert a.kind == "relaunch" and s.active == ("node1", "node2")
    s, a = step(s, StepExited(attempt=1, code=1, step=9))
    assert a.kind == "stop" and "same failure repeating" in a.reason
    s2 = launched()
    s2, _ = step(s2, StepExited(attempt=0, code=1, step=9))
    s2, a = step(s2, StepExited(attempt=1, code=1, step=15))  # made progress: a different failure
    assert a.kind == "relaunch"


def test_hang_blames_the_stalled_node_or_restarts_same():
    s = launched()
    s, a = step(s, Hang(attempt=0, suspects=("node2",), step=4, idle_s=30))
    assert a.kind == "relaunch" and s.suspects == ("node2",) and s.active == ("node1", "node3")
    s, a = step(s, Hang(attempt=1, suspects=("node1", "node3"), step=8, idle_s=30))
    assert a.kind == "update" and a.probe == ("node1", "node3")  # nobody to blame: probe before relaunching
    s, a = step(s, Probed(attempt=1, step=8, healthy=("node1", "node3")))
    assert a.kind == "relaunch" and s.active == ("node1", "node3")
    s, a = step(s, LaunchTimeout(attempt=2))
    assert a.kind == "relaunch" and s.restarts == 3


def test_lost_buffer_is_dropped_without_restart():
    s = launched()
    s, a = step(s, NodesLost(("node4",), detail="down"))
    assert a.kind == "update" and s.buffers == ("node3",) and "node4" in s.excluded and s.restarts == 0
    s, a = step(s, NodesLost(("node1", "node3")))
    assert a.kind == "relaunch" and s.active == ("node3", "node2") or a.kind == "stop"


def test_stop_requested():
    s, a = step(launched(), StopRequested())
    assert a.kind == "stop" and s.status == "stopped" and s.finished
    assert decide(s, StepExited(attempt=0, code=0)).kind == "ignore"


def test_journal_replay_rebuilds_state(tmp_path):
    nodes = ["node1", "node2", "node3", "node4"]
    journal_event(tmp_path, "allocation", nodes, job_id="7")
    s = initial_state(2, 5, nodes)
    events = [
        PreflightDone(healthy=tuple(nodes)),
        Fault(0, "node2", 1, 5, "nan loss"),
        SuspectChecked("node2", healthy=True),
        StepExited(attempt=1, code=1, dead_nodes=("node1",)),
    ]
    for ev in events:
        s, a = step(s, ev)
        journal_event(tmp_path, "info", a.nodes or (), action=a.to_json())
    assert replay(read_jsonl(tmp_path / "journal.jsonl"), 2, 5) == s
    # a resubmitted allocation keeps exclusions, restarts and attempt numbers
    journal_event(tmp_path, "allocation", ["node2", "node3", "node5"], job_id="8")
    s2 = replay(read_jsonl(tmp_path / "journal.jsonl"), 2, 5)
    assert s2.excluded == s.excluded and s2.restarts == s.restarts and s2.attempt == s.attempt
    assert s2.phase == "preflight" and s2.buffers == ("node2", "node3", "node5")
    assert Action.from_json(a.to_json()) == a


def test_simulated_1024_node_allocation_with_12_buffers_and_30_staggered_failures():
    """1,024 + 12 nodes; 30 failures (7 hard, 11 soft NaN, 12 hangs) at staggered steps, re-checks arriving one
    failure late, stale exits of replaced attempts, and two spares lost. Prints the slowest decision."""
    rng = random.Random(0)
    nodes = [f"gpu{i:04d}" for i in range(1, 1037)]
    s = initial_state(1024, 100, nodes)
    timings = []

    def timed(ev):
        nonlocal s
        t0 = time.perf_counter()
        a = decide(s, ev)
        timings.append(time.perf_counter() - t0)
        s = apply(s, a)
        return a

    assert timed(PreflightDone(healthy=tuple(nodes))).kind == "launch"
    kinds = (["hard", "soft", "hang"] * 7 + ["soft", "hang"] * 4 + ["hang"])
    assert len(kinds) == 30
    expected_excluded, pending_check = set(), []
    bad_recheck = {3}  # the 4th soft fault's node fails its re-check
    soft_seen = 0
    for i, kind in enumerate(kinds):
        step_no = 100 + 37 * i
        victim = rng.choice(s.active)
        attempt = s.attempt
        if kind == "hard":
            a = timed(StepExited(attempt=attempt, code=1, dead_nodes=(victim,), step=step_no,
                                 detail=f"Node failure on {victim}"))
            expected_excluded.add(victim)
        elif kind == "soft":
            a = timed(Fault(attempt=attempt, node=victim, rank=rng.randrange(8), step=step_no, what="nan loss"))
            pending_check.append((victim, soft_seen not in bad_recheck))
            soft_seen += 1
        else:
            a = timed(Hang(attempt=attempt, suspects=(victim,), step=step_no, idle_s=120))
            pending_check.append((victim, True))
        assert a.kind == "relaunch", (i, kind, a.reason)
        assert victim not in s.active and len(s.active) == 1024
        assert timed(StepExited(attempt=attempt, code=1, step=step_no)).kind == "ignore"  # the old step ending late
        while len(pending_check) > 1:  # re-checks arrive one failure late
            node, ok = pending_check.pop(0)
            timed(SuspectChecked(node, healthy=ok, detail="" if ok else "gemm known-answer mismatch"))
            if not ok:
                expected_excluded.add(node)
        if i in (5, 20):  # a spare node dies too
            lost = s.buffers[-1]
            assert timed(NodesLost((lost,), detail="down*")).kind == "update"
            expected_excluded.add(lost)
        check_pools(s, nodes)
    for node, ok in pending_check:
        timed(SuspectChecked(node, healthy=ok))
    assert timed(StepExited(attempt=s.attempt, code=0)).kind == "complete"
    assert s.status == "completed" and s.restarts == 30 and s.attempt == 30
    assert set(s.excluded) == expected_excluded and len(expected_excluded) == 10
    assert len(s.active) == 1024 and not set(s.active) & expected_excluded and s.suspects == ()
    assert len(s.buffers) == 1036 - 1024 - 10
    check_pools(s, nodes)
    print(f"\n1024-node simulation: {len(timings)} decisions, max {max(timings) * 1e3:.2f} ms, "
          f"mean {sum(timings) / len(timings) * 1e3:.3f} ms; excluded {len(s.excluded)}, buffers left {len(s.buffers)}")


def test_a_stop_still_takes_the_failed_node_out_of_the_job():
    s = launched(n=2, b=0)
    s, a = step(s, StepExited(attempt=0, code=1, dead_nodes=("node2",)))
    assert a.kind == "stop" and s.active == ("node1",) and "node2" in s.excluded
    s = launched(n=2, b=2, max_restarts=0)
    s, a = step(s, Fault(attempt=0, node="node1", rank=0, step=3, what="nan loss"))
    assert a.kind == "stop" and "max_restarts" in a.reason and s.active == ("node2",) and s.suspects == ("node1",)


def test_local_cluster_keeps_health_baselines_and_history_in_the_run(tmp_path):
    from moe_launch.conf.schema import AllToAllConfig, ClusterConfig, HealthConfig
    from moe_launch.orchestrator.supervisor import preflight_health_config

    local = preflight_health_config(HealthConfig(), ClusterConfig(kind="local"), tmp_path)
    assert local.alltoall.baseline_path == str(tmp_path / "a2a_baselines.json")
    assert local.store_dir == str(tmp_path / "store")
    chosen = HealthConfig(alltoall=AllToAllConfig(baseline_path="/srv/b.json"), store_dir="/srv/h")
    kept = preflight_health_config(chosen, ClusterConfig(kind="local"), tmp_path)
    assert (kept.alltoall.baseline_path, kept.store_dir) == ("/srv/b.json", "/srv/h")
    assert preflight_health_config(HealthConfig(), ClusterConfig(kind="slurm"), tmp_path) == HealthConfig()
