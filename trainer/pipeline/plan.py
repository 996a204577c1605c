"""The per-stage program of one pipeline step: compute actions interleaved with matched exchange rounds. Pure.

Why rounds. Point-to-point messages between two ranks must be posted in the same order on both sides, and with NCCL
a blocking send queued before a receive on the same pair can deadlock against the peer doing the reverse. So every
message is exchanged in a ROUND that both its sender and its receiver post as one batch (batch_isend_irecv): the
schedule is simulated with unit-length actions (schedule.simulate), every action gets an integer tick, and the
messages produced by the actions of tick t form round t. Each stage's program is

    for each tick t:  [Compute(its action at t), if any]  [Exchange(round t restricted to this stage), if any]

A message produced at tick t is consumed at a tick > t (the simulation starts an action only after its inputs
exist), so its receive was posted in an earlier Exchange; the runtime waits for it right before the consumer. By
induction over ticks no stage can wait on a message that is not posted, whatever the real durations are.

Messages between two chunks on the same stage (pp = 1 with virtual stages) never leave the process: `local=True`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from moe_launch.trainer.pipeline.schedule import Action, simulate, stage_of


@dataclass(frozen=True, order=True)
class Message:
    kind: str  # "act" (forward activation, chunk -> chunk+1) | "grad" (its gradient, chunk -> chunk-1)
    src_chunk: int
    dst_chunk: int
    mb: int

    def src_stage(self, pp: int) -> int:
        return stage_of(self.src_chunk, pp)

    def dst_stage(self, pp: int) -> int:
        return stage_of(self.dst_chunk, pp)


@dataclass(frozen=True)
class Compute:
    action: Action


@dataclass(frozen=True)
class Exchange:
    round: int
    sends: tuple[Message, ...]  # canonical order (sorted), identical to the peer's receive order
    recvs: tuple[Message, ...]


Op = Union[Compute, Exchange]


def output_message(a: Action, n_chunks: int) -> Message | None:
    """What an action produces for another chunk: F sends its activation forward, B the input gradient back."""
    if a.kind == "F" and a.chunk < n_chunks - 1:
        return Message("act", a.chunk, a.chunk + 1, a.mb)
    if a.kind == "B" and a.chunk > 0:
        return Message("grad", a.chunk, a.chunk - 1, a.mb)
    return None


def input_message(a: Action, n_chunks: int) -> Message | None:
    """What an action needs from another chunk before it can run."""
    if a.kind == "F" and a.chunk > 0:
        return Message("act", a.chunk - 1, a.chunk, a.mb)
    if a.kind == "B" and a.chunk < n_chunks - 1:
        return Message("grad", a.chunk + 1, a.chunk, a.mb)
    return None


def is_local(m: Message, pp: int) -> bool:
    return m.src_stage(pp) == m.dst_stage(pp)


def build_programs(orders: list[list[Action]], virtual: int = 1) -> list[list[Op]]:
    """One program per stage. Local messages (same stage) get no Exchange; the runtime hands them over directly."""
    pp = len(orders)
    n_chunks = pp * virtual
    timeline = simulate(orders, t_fwd=1.0, t_bwd=1.0, virtual=virtual)
    by_tick: dict[int, dict[int, Action]] = {}
    for s, slots in enumerate(timeline.slots):
        for slot in slots:
            by_tick.setdefault(int(slot.start), {})[s] = slot.action
    programs: list[list[Op]] = [[] for _ in range(pp)]
    for t in sorted(by_tick):
        actions = by_tick[t]
        messages = sorted(m for a in actions.values() if (m := output_message(a, n_chunks)) is not None
                          and not is_local(m, pp))
        for s in range(pp):
            if s in actions:
                programs[s].append(Compute(actions[s]))
            sends = tuple(m for m in messages if m.src_stage(pp) == s)
            recvs = tuple(m for m in messages if m.dst_stage(pp) == s)
            if sends or recvs:
                programs[s].append(Exchange(t, sends, recvs))
    return programs
