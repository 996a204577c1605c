"""The skew guard under expert parallelism: with the all-to-all dispatcher and every pair of both EP ranks routed to
rank 0's experts, rank 0 receives the worst case (ep * T * K rows); its guard runs them in chunks, and both ranks'
outputs and gradients equal the unguarded exchange."""

from __future__ import annotations

import torch
from test_parallel_dispatch import ExpertsOnly, problem, run

from moe_launch.conf.schema import ParallelConfig
from moe_launch.trainer.moe.reference import experts_reference
from moe_launch.trainer.moe.skew import ChunkedExperts, worst_case_rows
from moe_launch.trainer.parallel.dispatch import make_dispatcher
from moe_launch.trainer.parallel.groups import build_groups

EP, T, E, K = 4, 6, 8, 2  # the shapes of test_parallel_dispatch.problem


def _worker(rank: int, world: int, max_rows: int) -> dict:
    groups = build_groups(ParallelConfig(dp=1, ep=EP))
    p = problem("all_to_rank0")
    e_local = E // EP
    ex, tok = slice(rank * e_local, (rank + 1) * e_local), slice(rank * T, (rank + 1) * T)
    out = {}
    for name, guarded in (("plain", False), ("guarded", True)):
        layer = ExpertsOnly(p["wg"][ex], p["wu"][ex], p["wd"][ex], e_start=rank * e_local)
        guard = ChunkedExperts(experts_reference, max_rows)
        if guarded:
            layer.experts_fn = guard
        out[name] = run(p["x"][tok], p["w"][tok], p["idx"][tok], layer, p["probe"][tok],
                        make_dispatcher("alltoall", groups.ep))
        out[f"{name}_events"] = guard.drain()
    return out


def test_hot_rank_chunks_its_worst_case_and_matches_the_unguarded_exchange(rank_pool):
    results = rank_pool.run(_worker, EP, 5)
    hot = results[0]["guarded_events"]
    assert hot == [(worst_case_rows(T, K, EP, "alltoall"), -(-EP * T * K // 5))]  # one pair per received row
    assert all(r["guarded_events"] == [] for r in results[1:])  # the cold ranks receive nothing
    for r in results:
        for key, want in r["plain"].items():
            got = r["guarded"][key]
            if want is None:
                assert got is None, key
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
