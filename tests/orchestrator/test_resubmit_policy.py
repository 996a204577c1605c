"""The login side's cross-allocation policy (pure functions of orchestrator/login.py): time-limit continuations do not
use up supervisor.max_resubmits, supervisor.max_allocations caps every allocation, and a resubmission asks for only the
buffers the partition can still give."""

from __future__ import annotations

from moe_launch.conf.schema import ClusterConfig, SupervisorConfig
from moe_launch.orchestrator.plan import PartitionInfo
from moe_launch.orchestrator.resubmit import (
    allocation_never_started,
    allocation_verdict,
    buffers_for_resubmit,
    pending_cannot_start,
    submitted_at,
)


def _resubmit(continuation: bool) -> dict:
    return {"kind": "resubmit", "details": {"continuation": continuation, "handle": "9"}}


def test_continuations_never_use_up_max_resubmits():
    sup = SupervisorConfig(max_resubmits=2)
    fourteen_windows = [_resubmit(True)] * 13  # a two-week run on 24-hour limits
    assert allocation_verdict(True, fourteen_windows, 14, sup) is None


def test_lost_allocations_use_up_max_resubmits_whatever_the_continuations():
    sup = SupervisorConfig(max_resubmits=2)
    records = [_resubmit(True), _resubmit(False), _resubmit(True), _resubmit(False)]
    why = allocation_verdict(False, records, 5, sup)
    assert why is not None and "supervisor.max_resubmits=2" in why and "3 time(s)" in why
    assert allocation_verdict(True, records, 5, sup) is None  # a clean checkpoint still continues
    assert allocation_verdict(False, records[:2], 3, sup) is None  # one lost so far: one more allowed


def test_max_allocations_caps_continuations_too():
    sup = SupervisorConfig(max_allocations=3)
    assert allocation_verdict(True, [_resubmit(True)], 2, sup) is None
    why = allocation_verdict(True, [_resubmit(True)] * 2, 3, sup)
    assert why is not None and "supervisor.max_allocations=3" in why


def test_resubmit_shrinks_buffers_to_what_the_partition_can_give():
    cluster = ClusterConfig(kind="slurm", nodes=2, buffers=3)
    part = PartitionInfo(name="debug", nodes=tuple(f"node{i}" for i in range(1, 7)), unavailable=("node4",))
    assert buffers_for_resubmit(cluster, part, ()) == 3  # 5 usable
    assert buffers_for_resubmit(cluster, part, ("node2", "node3")) == 1  # node4 down too: 3 usable
    assert buffers_for_resubmit(cluster, part, ("node1", "node2", "node3")) == 0  # 2 usable: N alone
    assert buffers_for_resubmit(cluster, part, ("node1", "node2", "node3", "node5")) == 0  # pends for N, never < 0


def test_a_pending_allocation_is_resized_when_a_node_dies_after_it_was_sized():
    nodes6 = tuple(f"node{i}" for i in range(1, 7))
    ex = ("node1", "node2", "node3")  # asked N=2 + B=1 of node4..node6
    assert pending_cannot_start(PartitionInfo("debug", nodes6), 2, 1, ex) is None  # fits: let it pend
    why = pending_cannot_start(PartitionInfo("debug", nodes6, unavailable=("node5",)), 2, 1, ex)
    assert why == "it asks for 3 nodes, the partition has 2 usable (node5 unavailable)"
    # fewer than N usable: no smaller request would start either; nodes may come back, so it pends
    assert pending_cannot_start(PartitionInfo("debug", nodes6, unavailable=("node5", "node6")), 2, 1, ex) is None
    assert pending_cannot_start(PartitionInfo("debug", nodes6, unavailable=("node5",)), 2, 0, ex) is None  # no B
    assert pending_cannot_start(None, 2, 1, ex) is None


def test_an_allocation_without_its_supervisors_record_never_started():
    records = [{"kind": "start", "time": 10.0, "details": {"handle": "7", "cluster": "slurm"}},
               {"kind": "allocation", "time": 11.0, "details": {"job_id": "7"}},
               {"kind": "resubmit", "time": 70.0, "details": {"handle": "8", "cluster": "slurm"}}]
    assert not allocation_never_started(records, {"handle": "7", "cluster": "slurm"})
    assert allocation_never_started(records, {"handle": "8", "cluster": "slurm"})
    assert not allocation_never_started(records, {"handle": "4242", "cluster": "local"})  # local: a process, no job
    assert submitted_at(records, "8") == 70.0 and submitted_at(records, "9") == 0.0
