"""Isolation strategy against a model cluster: each node has a slowdown factor; a group runs at the speed of its
slowest member. The strategy must name exactly the slow nodes, with O(log N) tests for a single bad node."""

from __future__ import annotations

import math

import pytest

from moe_launch.health.isolate import GroupMeasurement, group_is_bad, isolate, isolation_cut


def model_cluster(n: int, slow: dict[int, float], corrupt: frozenset[int] = frozenset(), jitter: float = 0.04):
    nodes = [f"node{i}" for i in range(1, n + 1)]
    calls: list[list[str]] = []

    def measure(group: list[str]) -> GroupMeasurement:
        calls.append(group)
        ids = [int(g[4:]) for g in group]
        base = 100.0 / len(group)  # bandwidth falls with node count, as on real fabrics
        factor = max(slow.get(i, 1.0) for i in ids)
        wobble = 1.0 - jitter * ((sum(ids) * 7919) % 13) / 13  # deterministic noise, below the 10% threshold
        wrong = 5 if corrupt & set(ids) else 0
        return GroupMeasurement(tuple(group), base / factor * wobble, wrong)

    return nodes, measure, calls


@pytest.mark.parametrize("n", [4, 5, 6, 8, 16, 32])
def test_single_slow_node_is_named_with_few_tests(n):
    for bad in {1, 2, n // 2 + 1, n}:
        nodes, measure, calls = model_cluster(n, {bad: 3.0})
        r = isolate(nodes, measure, baseline=lambda k: None, threshold=0.9)
        assert r.bad == [f"node{bad}"], (n, bad, r)
        assert r.inconclusive == []
        assert len(calls) <= 2 * math.ceil(math.log2(n)) + 3, (n, bad, len(calls))


def test_wrong_elements_convict_even_at_full_speed():
    nodes, measure, _ = model_cluster(8, {}, corrupt=frozenset({6}))
    r = isolate(nodes, measure, baseline=lambda k: None, threshold=0.9)
    assert r.bad == ["node6"]


def test_two_bad_nodes_in_different_halves_without_baselines():
    nodes, measure, _ = model_cluster(8, {2: 4.0, 7: 4.0})
    r = isolate(nodes, measure, baseline=lambda k: None, threshold=0.9)
    # both halves equally slow: nothing to compare them with, so no node is cleared or convicted
    assert r.bad == [] and sorted(r.inconclusive) == sorted(nodes)


def test_two_bad_nodes_with_baselines():
    nodes, measure, _ = model_cluster(8, {2: 4.0, 7: 4.0})
    r = isolate(nodes, measure, baseline=lambda k: 100.0 / k, threshold=0.9)
    assert sorted(r.bad) == ["node2", "node7"] and r.inconclusive == []


def test_two_bad_nodes_in_one_quarter_found_via_anchor_pairs():
    nodes, measure, _ = model_cluster(8, {1: 4.0, 3: 4.0})
    r = isolate(nodes, measure, baseline=lambda k: None, threshold=0.9)
    assert sorted(r.bad) == ["node1", "node3"]


def test_two_nodes_cannot_be_resolved():
    nodes, measure, _ = model_cluster(2, {2: 3.0})
    r = isolate(nodes, measure, baseline=lambda k: None, threshold=0.9)
    assert r.bad == [] and r.inconclusive == ["node1", "node2"]


def test_failure_that_does_not_reproduce():
    nodes, measure, _ = model_cluster(4, {})
    r = isolate(nodes, measure, baseline=lambda k: 100.0 / k, threshold=0.9)
    assert r.bad == [] and r.inconclusive == []
    assert any("did not reproduce" in n for n in r.notes)
    # without a baseline for 2 nodes the same answers cannot clear anybody: alike halves could both be slow
    r = isolate(nodes, measure, baseline=lambda k: None, threshold=0.9)
    assert r.bad == [] and sorted(r.inconclusive) == nodes


def test_group_is_bad_rules():
    ok = GroupMeasurement(("a", "b"), 9.5)
    assert not group_is_bad(ok, 10.0, 0.9)
    assert group_is_bad(GroupMeasurement(("a", "b"), 8.9), 10.0, 0.9)
    assert group_is_bad(GroupMeasurement(("a", "b"), 50.0, wrong=1), 10.0, 0.9)
    assert group_is_bad(GroupMeasurement(("a", "b"), 0.0, error="srun failed"), None, 0.9)
    assert not group_is_bad(ok, None, 0.9)


def test_noisy_healthy_pair_is_not_convicted_when_depth_is_known():
    """On the shared CI machine a healthy pair can measure several x below another; the slow node is ~100x below."""
    nodes = [f"node{i}" for i in range(1, 5)]
    speed = {("node1", "node2"): 0.0015, ("node3", "node4"): 0.9, ("node1", "node3"): 0.18, ("node2", "node3"): 0.0016}

    def measure(group):
        return GroupMeasurement(tuple(group), speed[tuple(group)])

    r = isolate(nodes, measure, baseline=lambda k: None, threshold=0.9, depth=0.015)
    assert r.bad == ["node2"] and sorted(r.cleared) == ["node1", "node3", "node4"]
    # with the threshold alone, the noisy healthy pair (0.2 of the best) would convict node1 as well
    assert isolate(nodes, measure, baseline=lambda k: None, threshold=0.9).bad == ["node1", "node2"]
    assert isolation_cut(0.9, 0.81) == pytest.approx(0.9) and isolation_cut(0.9, 0.04) == pytest.approx(0.2)
    assert isolation_cut(0.9, None) == 0.9


def test_a_pair_slow_once_is_measured_again_before_its_suspect_is_convicted():
    """The CI machine once measured a healthy node's anchor pair 23x below the best pair, once."""
    nodes = [f"node{i}" for i in range(1, 5)]
    speed = {("node1", "node2"): 0.001, ("node3", "node4"): 1.0, ("node1", "node3"): 0.02, ("node2", "node3"): 0.001}
    seen: list[tuple[str, ...]] = []

    def measure(group):
        key = tuple(group)
        first_of_node1 = key == ("node1", "node3") and key not in seen
        seen.append(key)
        return GroupMeasurement(key, speed[key] if first_of_node1 or key != ("node1", "node3") else 0.95)

    r = isolate(nodes, measure, baseline=lambda k: None, threshold=0.25, depth=0.001)
    assert r.bad == ["node2"] and sorted(r.cleared) == ["node1", "node3", "node4"], r
    assert seen.count(("node1", "node3")) == 2 and seen.count(("node2", "node3")) == 2  # each slow pair twice
    assert any("then at speed" in n for n in r.notes)


def test_wrong_elements_are_not_measured_again():
    nodes, measure, calls = model_cluster(4, {}, corrupt=frozenset({4}))
    r = isolate(nodes, measure, baseline=lambda k: None, threshold=0.9)
    assert r.bad == ["node4"]
    assert sum(1 for c in calls if "node4" in c and len(c) == 2) == 2  # its half, then its anchor pair once
