"""Bad-node isolation: after the whole-allocation all-to-all failed, name the node(s) responsible.

Pure: the caller passes `measure(nodes) -> GroupMeasurement` (which runs a real all-to-all on those nodes) and
`baseline(n_nodes) -> busbw or None`; this module only decides which groups to test and what the answers mean.

Strategy (binary splitting, about 2·log2(N) + 3 tests for one bad node, instead of N for leave-one-out):
  1. Split the suspect group into two halves of EQUAL size (an odd node out is set aside), and measure both. Equal
     sizes matter: all-to-all bandwidth depends on the node count, so halves are comparable with each other (and
     with a stored baseline for that count, when there is one).
  2. A half is bad when it has wrong elements, did not run, or its busbw is below `cut` × reference, where the
     reference is the baseline for that node count if stored, else the best group measured at that size, and
     cut = min(threshold, sqrt(depth)); depth = (whole group's busbw) / (its baseline). A culprit must reproduce at
     least half (on a log scale) of the slowdown that failed the whole group: on a noisy machine a healthy pair may
     measure 3x below another, while the group with the bad node is 100x below; threshold alone would convict both.
     Good halves' nodes are cleared and become anchors; bad halves are split again.
  3. A bad group of 2 or 3 nodes, every node set aside, and a group whose two halves look alike although their
     union failed (a bad node in each half) are resolved by pairing each member with a cleared anchor node; the
     pairs are judged against the baseline for 2 nodes, else against a pair of two anchors measured for reference.
     A pair judged bad is measured again, and its suspect convicted only when the repeat is bad as well.
Limits: with no anchor at all (N = 2 or 3, or both top-level halves equally slow) nothing can be cleared, and the
suspects are reported `inconclusive` rather than guessed at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class GroupMeasurement:
    nodes: tuple[str, ...]
    busbw_gbs: float  # at the judged (largest) message size; 0 when the test did not run
    wrong: int = 0
    error: Optional[str] = None


@dataclass
class IsolationResult:
    bad: list[str] = field(default_factory=list)  # nodes proven responsible
    inconclusive: list[str] = field(default_factory=list)  # suspects the tests could not clear or convict
    cleared: list[str] = field(default_factory=list)
    tests: list[GroupMeasurement] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "bad": self.bad, "inconclusive": self.inconclusive, "cleared": self.cleared, "notes": self.notes,
            "tests": [{"nodes": list(t.nodes), "busbw_gbs": t.busbw_gbs, "wrong": t.wrong, "error": t.error}
                      for t in self.tests],
        }


Measure = Callable[[list[str]], GroupMeasurement]
Baseline = Callable[[int], Optional[float]]


def group_is_bad(m: GroupMeasurement, reference: Optional[float], threshold: float) -> bool:
    if m.error is not None or m.wrong > 0:
        return True
    return reference is not None and reference > 0 and m.busbw_gbs < threshold * reference


class _Isolator:
    def __init__(self, measure: Measure, baseline: Baseline, threshold: float):
        self.measure, self.baseline, self.threshold = measure, baseline, threshold
        self.result = IsolationResult()
        self.best: dict[int, float] = {}  # best healthy-looking busbw per group size seen so far

    def _run(self, nodes: list[str]) -> GroupMeasurement:
        m = self.measure(list(nodes))
        self.result.tests.append(m)
        if m.error is None and m.wrong == 0:
            self.best[len(nodes)] = max(self.best.get(len(nodes), 0.0), m.busbw_gbs)
        return m

    def _reference(self, size: int) -> Optional[float]:
        stored = self.baseline(size)
        return stored if stored else self.best.get(size)

    def _bad(self, m: GroupMeasurement) -> bool:
        return group_is_bad(m, self._reference(len(m.nodes)), self.threshold)

    def _clear(self, nodes: list[str]) -> None:
        self.result.cleared += [n for n in nodes if n not in self.result.cleared]

    def split(self, group: list[str], loose: list[str]) -> list[str]:
        """Returns the members that still need an anchor test; appends set-aside nodes to `loose`."""
        if len(group) < 4:
            return list(group)
        half = len(group) // 2
        a, b = group[:half], group[half : 2 * half]
        loose += group[2 * half :]
        ma, mb = self._run(a), self._run(b)
        bad_a, bad_b = self._bad(ma), self._bad(mb)
        if not bad_a and not bad_b:
            if self.baseline(half) or len(group) % 2:
                # judged against a stored baseline (absolute), or the odd node out explains the failure
                self._clear(a + b)
                return []
            # the union failed but the halves look alike: both may hold a bad node. Test every member on its own.
            self.result.notes.append(f"halves {a} and {b} look alike although their union failed")
            return list(group[: 2 * half])
        pending: list[str] = []
        for nodes, bad in ((a, bad_a), (b, bad_b)):
            if bad:
                pending += self.split(nodes, loose)
            else:
                self._clear(nodes)
        return pending

    def anchor_tests(self, members: list[str]) -> None:
        anchors = [n for n in self.result.cleared if n not in members]
        if not anchors:
            self.result.notes.append(f"no healthy anchor node to test {members} against")
            self.result.inconclusive += [n for n in members if n not in self.result.inconclusive]
            return
        if not self.baseline(2) and 2 not in self.best and len(anchors) >= 2:
            self._run(anchors[:2])  # a healthy pair: the reference the suspects' pairs are judged against
        pairs = [(member, self._run([member, anchors[0]])) for member in members]
        for member, m in pairs:  # judged after all pairs ran, so each is compared with the best of them
            if self._bad(m) and self._confirmed(m):
                self.result.bad.append(member)
            else:
                self._clear([member])

    def _confirmed(self, m: GroupMeasurement) -> bool:
        """A slow pair is measured once more before its suspect is convicted: conviction excludes a node for good,
        and one slow measurement of a healthy pair (a busy host, a transient fabric stall) is not proof. Wrong
        elements and errors are not retried."""
        if m.error is not None or m.wrong > 0:
            return True
        again = self._run(list(m.nodes))
        if self._bad(again):
            return True
        self.result.notes.append(f"{list(m.nodes)} measured slow once, then at speed: not convicted")
        return False


def isolation_cut(threshold: float, depth: Optional[float]) -> float:
    """The fraction of the reference below which a sub-group is bad (see the module docstring)."""
    if depth is None or depth <= 0 or depth >= 1:
        return threshold
    return min(threshold, math.sqrt(depth))


def isolate(nodes: list[str], measure: Measure, baseline: Baseline, threshold: float,
            depth: Optional[float] = None) -> IsolationResult:
    """depth: the failed whole group's busbw / its baseline (None when it failed on wrong elements or errors)."""
    iso = _Isolator(measure, baseline, isolation_cut(threshold, depth))
    loose: list[str] = []
    pending = iso.split(list(nodes), loose)
    if pending or loose:
        iso.anchor_tests(pending + loose)
    r = iso.result
    if not r.bad and not r.inconclusive:
        r.notes.append("every sub-group passed: the failure did not reproduce on any subset")
    return r
