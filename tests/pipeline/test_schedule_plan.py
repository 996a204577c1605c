"""Schedules and programs, without processes: orders, dependencies, bubbles, in-flight micro-batches, and that every
point-to-point round is posted identically by both of its ends."""

from __future__ import annotations

import pytest

from moe_launch.errors import ConfigError
from moe_launch.trainer.pipeline.plan import Compute, Exchange, build_programs, input_message, is_local
from moe_launch.trainer.pipeline.schedule import Action, build_schedule, simulate, validate

F, B = (lambda c, m: Action("F", c, m)), (lambda c, m: Action("B", c, m))
CASES = [(name, pp, v, M) for pp in (1, 2, 3, 4) for M in (pp, 2 * pp, 8)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3))
         if name != "interleaved" or M % pp == 0]


def test_orders_of_the_three_schedules():
    assert build_schedule("gpipe", 2, 3) == [
        [F(0, 0), F(0, 1), F(0, 2), B(0, 0), B(0, 1), B(0, 2)],
        [F(1, 0), F(1, 1), F(1, 2), B(1, 0), B(1, 1), B(1, 2)]]
    assert build_schedule("1f1b", 3, 4) == [
        [F(0, 0), F(0, 1), F(0, 2), B(0, 0), F(0, 3), B(0, 1), B(0, 2), B(0, 3)],
        [F(1, 0), F(1, 1), B(1, 0), F(1, 2), B(1, 1), F(1, 3), B(1, 2), B(1, 3)],
        [F(2, 0), B(2, 0), F(2, 1), B(2, 1), F(2, 2), B(2, 2), F(2, 3), B(2, 3)]]
    # interleaved, P=2, V=2 (chunks 0, 2 on stage 0; 1, 3 on stage 1): micro-batches pass chunk 0 in groups of P
    assert build_schedule("interleaved", 2, 4, 2) == [
        [F(0, 0), F(0, 1), F(2, 0), F(2, 1), F(0, 2), B(2, 0), F(0, 3), B(2, 1), F(2, 2), B(0, 0), F(2, 3), B(0, 1),
         B(2, 2), B(2, 3), B(0, 2), B(0, 3)],
        [F(1, 0), F(1, 1), F(3, 0), B(3, 0), F(3, 1), B(3, 1), F(1, 2), B(1, 0), F(1, 3), B(1, 1), F(3, 2), B(3, 2),
         F(3, 3), B(3, 3), B(1, 2), B(1, 3)]]


@pytest.mark.parametrize("name,pp,v,M", CASES)
def test_every_schedule_is_complete_and_respects_dependencies(name, pp, v, M):
    orders = build_schedule(name, pp, M, v if name == "interleaved" else 1)
    v = v if name == "interleaved" else 1
    validate(orders, M, v)
    timeline = simulate(orders, t_fwd=1.0 / v, t_bwd=2.0 / v, virtual=v)  # a chunk is 1/V of a stage's layers
    end = {slot.action: slot.end for slots in timeline.slots for slot in slots}
    start = {slot.action: slot.start for slots in timeline.slots for slot in slots}
    for a in start:
        if a.kind == "F" and a.chunk > 0:
            assert start[a] >= end[F(a.chunk - 1, a.mb)]
        if a.kind == "B":
            assert start[a] >= end[F(a.chunk, a.mb)]
            if a.chunk < pp * v - 1:
                assert start[a] >= end[B(a.chunk + 1, a.mb)]
    # bubble per stage: (P-1) * (t_f + t_b) / V, the textbook numbers (interleaving divides it by V)
    for s in range(pp):
        assert timeline.bubble(s) == pytest.approx((pp - 1) * 3.0 / v)
    assert timeline.bubble_fraction == pytest.approx((pp - 1) / (M + pp - 1) if v == 1 else
                                                     ((pp - 1) * 3.0 / v) / (3.0 * M + (pp - 1) * 3.0 / v))


@pytest.mark.parametrize("pp,M", [(2, 4), (4, 8), (4, 12)])
def test_1f1b_bounds_in_flight_micro_batches_by_stages_gpipe_by_micro_batches(pp, M):
    one = simulate(build_schedule("1f1b", pp, M))
    gp = simulate(build_schedule("gpipe", pp, M))
    assert [one.peak_in_flight(s) for s in range(pp)] == [pp - s for s in range(pp)]
    assert [gp.peak_in_flight(s) for s in range(pp)] == [M] * pp
    assert one.makespan == gp.makespan  # same bubble, less memory


def test_a_wrong_order_is_reported_as_a_deadlock():
    orders = build_schedule("1f1b", 2, 2)
    orders[1] = [B(1, 0), F(1, 0), F(1, 1), B(1, 1)]  # backward before its forward
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(orders)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="parallel.microbatches"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ConfigError, match="parallel.pp_virtual_stages"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ConfigError, match="parallel.pp_schedule"):
        build_schedule("zigzag", 2, 4)


@pytest.mark.parametrize("name,pp,v,M", CASES)
def test_programs_post_every_round_identically_on_both_ends(name, pp, v, M):
    v = v if name == "interleaved" else 1
    orders = build_schedule(name, pp, M, v)
    programs = build_programs(orders, v)
    assert [[op.action for op in prog if isinstance(op, Compute)] for prog in programs] == orders
    rounds: dict[int, dict[int, Exchange]] = {}
    for s, prog in enumerate(programs):
        for op in prog:
            if isinstance(op, Exchange):
                rounds.setdefault(op.round, {})[s] = op
    for by_stage in rounds.values():
        for s, op in by_stage.items():
            for peer in range(pp):
                out = [m for m in op.sends if m.dst_stage(pp) == peer]
                if out:  # the peer receives exactly these messages from s, in the same order, in the same round
                    assert [m for m in by_stage[peer].recvs if m.src_stage(pp) == s] == out
    # every remote input is received in an Exchange before the action that consumes it; sent after it is produced
    for s, prog in enumerate(programs):
        received, produced_at = set(), {}
        for i, op in enumerate(prog):
            if isinstance(op, Exchange):
                received.update(op.recvs)
                for m in op.sends:
                    assert produced_at[(m.src_chunk, m.mb, m.kind)] < i
            else:
                a = op.action
                need = input_message(a, pp * v)
                if need is not None and not is_local(need, pp):
                    assert need in received, (s, a)
                produced_at[(a.chunk, a.mb, "act" if a.kind == "F" else "grad")] = i
