"""Pipeline schedules as pure functions: the ordered compute actions of every stage, and a simulator that checks them.

Terms. P pipeline stages (ranks of the pp axis), V virtual stages per rank (model chunks), C = P*V chunks in model
order, M micro-batches. Chunk c lives on stage c % P (Megatron's interleaved placement; with V = 1, chunk = stage).
An action is F(c, m) (forward of chunk c on micro-batch m) or B(c, m) (its backward). Dependencies:

    F(c, m)  needs F(c-1, m)                      (the activation from the previous chunk)
    B(c, m)  needs F(c, m) and B(c+1, m)          (its own saved graph, the gradient from the next chunk)

A schedule returns one list of actions per stage: the order that stage computes in. Communication is not part of
the schedule; trainer/pipeline/plan.py derives it from the simulated timeline.

    gpipe        all forwards, then all backwards (activations of all M micro-batches live at once)
    1f1b         P-s-1 warm-up forwards on stage s, then alternate one forward / one backward, then drain
                 (at most P-s micro-batches in flight: memory bounded by P, not M)
    interleaved  1F1B over V chunks per stage, in groups of P micro-batches (needs M % P == 0); the bubble
                 shrinks by V at the cost of V times more point-to-point messages
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe_launch.errors import ConfigError


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F" | "B"
    chunk: int  # global chunk index, 0..C-1
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


def stage_of(chunk: int, pp: int) -> int:
    return chunk % pp


def gpipe(pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    _require_plain(virtual, "gpipe")
    return [[Action("F", s, m) for m in range(microbatches)] + [Action("B", s, m) for m in range(microbatches)]
            for s in range(pp)]


def one_f_one_b(pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    _require_plain(virtual, "1f1b")
    orders = []
    for s in range(pp):
        warmup = min(pp - s - 1, microbatches)
        order = [Action("F", s, m) for m in range(warmup)]
        for i in range(microbatches - warmup):
            order += [Action("F", s, warmup + i), Action("B", s, i)]
        order += [Action("B", s, m) for m in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return orders


def interleaved(pp: int, microbatches: int, virtual: int) -> list[list[Action]]:
    """The k-th forward of stage s runs local chunk (k // P) % V on micro-batch (k // (P*V)) * P + k % P: P
    micro-batches pass through chunk 0, then the same P through chunk 1, ... Backwards walk the chunks in reverse.
    Warm-up: enough forwards that the first backward's gradient can arrive, 2*(P-s-1) + (V-1)*P."""
    if microbatches % pp:
        raise ConfigError("parallel.microbatches",
                          f"{microbatches} is not a multiple of parallel.pp={pp}, which the interleaved schedule needs",
                          f"use a multiple of {pp} (e.g. {pp * max(1, microbatches // pp)})")
    total = microbatches * virtual

    def nth(s: int, k: int, backward: bool) -> Action:
        local = (k // pp) % virtual
        if backward:
            local = virtual - 1 - local
        mb = (k // (pp * virtual)) * pp + k % pp
        return Action("B" if backward else "F", local * pp + s, mb)

    orders = []
    for s in range(pp):
        warmup = min(2 * (pp - s - 1) + (virtual - 1) * pp, total)
        order = [nth(s, k, False) for k in range(warmup)]
        for i in range(total - warmup):
            order += [nth(s, warmup + i, False), nth(s, i, True)]
        order += [nth(s, k, True) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def _require_plain(virtual: int, name: str) -> None:
    if virtual != 1:
        raise ConfigError("parallel.pp_virtual_stages", f"{virtual} virtual stages with the {name} schedule",
                          "use parallel.pp_schedule=interleaved, or pp_virtual_stages=1")


SCHEDULES: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def build_schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    if name not in SCHEDULES:
        raise ConfigError("parallel.pp_schedule", f"got {name!r}", f"use one of {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise ConfigError("parallel.microbatches", f"got {microbatches}", "use at least 1 micro-batch")
    return SCHEDULES[name](pp, microbatches, virtual)


# -- simulation ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    slots: list[list[Slot]]  # per stage, in execution order
    makespan: float

    def busy(self, stage: int) -> float:
        return sum(s.end - s.start for s in self.slots[stage])

    def bubble(self, stage: int) -> float:
        """Idle time of a stage inside the step (from time 0 to the makespan)."""
        return self.makespan - self.busy(stage)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stage-time of the step: 1 - sum busy / (P * makespan)."""
        P = len(self.slots)
        return 1.0 - sum(self.busy(s) for s in range(P)) / (P * self.makespan) if self.makespan else 0.0

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batch chunks whose forward ran and whose backward did not yet: activations held at once."""
        live = peak = 0
        for slot in self.slots[stage]:
            live += 1 if slot.action.kind == "F" else -1
            peak = max(peak, live)
        return peak


def dependencies(a: Action, n_chunks: int) -> list[Action]:
    if a.kind == "F":
        return [Action("F", a.chunk - 1, a.mb)] if a.chunk > 0 else []
    deps = [Action("F", a.chunk, a.mb)]
    if a.chunk < n_chunks - 1:
        deps.append(Action("B", a.chunk + 1, a.mb))
    return deps


def validate(orders: list[list[Action]], microbatches: int, virtual: int = 1) -> None:
    """Every stage runs exactly the F and B of its own chunks for every micro-batch, once each."""
    pp = len(orders)
    for s, order in enumerate(orders):
        want = sorted(Action(k, c, m) for k in "FB" for c in range(s, pp * virtual, pp) for m in range(microbatches))
        if sorted(order) != want:
            raise ValueError(f"stage {s} does not run each of its actions exactly once: {order}")


def simulate(orders: list[list[Action]], t_fwd: float = 1.0, t_bwd: float = 2.0, virtual: int = 1) -> Timeline:
    """Run the per-stage orders against the dependencies with fixed action durations (per chunk) and zero
    communication time. Raises ValueError on a deadlock (an order that waits for something it must itself produce
    later). Pure; used by tests, by the communication plan (unit durations) and by the benchmark (measured ones)."""
    pp = len(orders)
    n_chunks = pp * virtual
    done: dict[Action, float] = {}
    pos, free = [0] * pp, [0.0] * pp
    slots: list[list[Slot]] = [[] for _ in range(pp)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                deps = dependencies(a, n_chunks)
                if any(d not in done for d in deps):
                    break
                start = max([free[s]] + [done[d] for d in deps])
                end = start + (t_fwd if a.kind == "F" else t_bwd)
                done[a], free[s] = end, end
                slots[s].append(Slot(a, start, end))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][pos[s]] for s in range(pp) if pos[s] < len(orders[s])}
            raise ValueError(f"schedule deadlocks: next actions {stuck} wait on actions that never run first")
    return Timeline(slots=slots, makespan=max(free) if pp else 0.0)
