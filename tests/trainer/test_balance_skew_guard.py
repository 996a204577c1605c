"""Routing-skew guard: the worst-case expert rows are known up front, a stage above its row budget runs in
checkpointed chunks with the same result (tested with every token routed to one expert), the trainer journals the
worst case and the chunked calls, and layers whose max/mean load is above train.expert_load_alert are reported."""

from __future__ import annotations

import pytest
import torch
from trainer_harness import tiny_cfg, write_run

from moe_launch.conf.schema import MoEConfig
from moe_launch.errors import ConfigError
from moe_launch.rundir import EXIT_OK, read_jsonl
from moe_launch.trainer.moe.layer import MoELayer
from moe_launch.trainer.moe.reference import experts_reference
from moe_launch.trainer.moe.skew import (
    ChunkedExperts,
    balanced_rows,
    expert_bytes_per_row,
    load_alerts,
    newly_above,
    rows_budget,
    worst_case_rows,
)

torch.set_num_threads(1)
T, D, E, K = 40, 16, 8, 2


def test_worst_case_is_every_rank_routing_every_pair_here():
    assert worst_case_rows(1024, 8, ep=4, dispatcher="alltoall") == 4 * 1024 * 8
    assert balanced_rows(1024, 8, ep=4, dispatcher="alltoall") == 1024 * 8  # skew multiplies it by up to ep
    assert balanced_rows(1024, 8, ep=4, dispatcher="allgather") == worst_case_rows(1024, 8, 4, "allgather")
    # 2 layers keep (2D + 2F) per row, the one in backward holds (3D + 4F) more
    assert expert_bytes_per_row(d_model=8, expert_hidden=4, dtype_bytes=2, moe_layers=2) == (24 * 2 + 40) * 2
    assert rows_budget(free_bytes=10_000, bytes_per_row=400) == 25
    assert rows_budget(free_bytes=0, bytes_per_row=400) == 1  # still progresses


def _all_to_expert_zero_layer(impl: str = "reference") -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, expert_hidden=24, impl=impl))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():  # a router that sends every token to experts 0 and 1 (inputs have x[:, 0] = 1)
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 0] = 20.0, 10.0
    return layer


def _run(layer: MoELayer, x_BSD: torch.Tensor):
    for p in layer.parameters():
        p.grad = None
    x = x_BSD.clone().requires_grad_()
    y, stats = layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}, stats.counts_E


@pytest.mark.parametrize("max_rows", [K, 6, 3 * K + 1])
def test_chunked_expert_stage_equals_the_unchunked_one_under_total_skew(max_rows):
    layer = _all_to_expert_zero_layer()
    x_BSD = torch.randn(2, T // 2, D)
    x_BSD[..., 0] = 1.0
    y0, dx0, g0, counts = _run(layer, x_BSD)
    assert counts.tolist() == [T, T] + [0] * (E - 2)  # total skew: two experts take every pair
    guard = ChunkedExperts(experts_reference, max_rows)
    layer.experts_fn = guard
    y1, dx1, g1, _ = _run(layer, x_BSD)
    (rows, chunks), = guard.drain()
    assert rows == T * K and chunks == -(-T // max(1, max_rows // K))
    # rows are independent: chunking changes the output only by the rounding of smaller matrix products
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-6)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=1e-6)
    for n in g0:  # a weight gradient sums over all rows: per chunk, then over chunks (another summation order)
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5)


def test_calls_within_the_budget_are_not_chunked():
    guard = ChunkedExperts(experts_reference, max_rows=T * K)
    layer = _all_to_expert_zero_layer()
    layer.experts_fn = guard
    _run(layer, torch.randn(1, T, D))
    assert guard.drain() == []


def test_load_alert_names_the_skewed_layers_only_once_per_crossing():
    counts_LE = torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0], [13, 9, 9, 9]])
    assert load_alerts(counts_LE, 2.0) == [(1, 4.0)]
    assert load_alerts(counts_LE, 0.0) == []
    new, above = newly_above([(1, 4.0)], set())
    assert new == [(1, 4.0)] and above == {1}
    assert newly_above([(1, 3.9), (2, 2.5)], above) == ([(2, 2.5)], {1, 2})  # layer 1 still above: said already
    assert newly_above([], {1, 2}) == ([], set())  # back to balance: a later crossing is news again


def test_config_checks_name_the_key():
    from moe_launch.conf.schema import TrainConfig

    with pytest.raises(ConfigError) as err:
        TrainConfig(max_memory_fraction=1.5)
    assert err.value.key == "train.max_memory_fraction"


def test_trainer_chunks_when_the_worst_case_does_not_fit_and_journals_it(tmp_path, data_cache):
    from moe_launch.trainer.loop import Trainer

    losses = {}
    for name, fraction in (("roomy", 0.9), ("tight", 1e-9)):
        cfg = tiny_cfg(data_cache, steps=2, ckpt_interval=0, dtype="fp32", max_memory_fraction=fraction,
                       expert_load_alert=1.01)
        rd = write_run(tmp_path / name, cfg)
        assert Trainer(cfg, rd).train() == EXIT_OK
        losses[name] = [r["loss"] for r in read_jsonl(rd.metrics)]
        skew = [e["details"] for e in read_jsonl(rd.journal) if e["kind"] == "skew"]
        m = cfg.model
        assert skew[0]["worst_case_rows"] == cfg.train.micro_batch_size * cfg.train.seq_len * m.moe.top_k
        assert skew[0]["chunked"] is (name == "tight")
        chunked = [s for s in skew if "chunked_calls" in s]
        assert len(chunked) == (1 if name == "tight" else 0)  # recorded once: the size never grew
        if chunked:
            assert chunked[0]["max_chunks"] == cfg.train.micro_batch_size * cfg.train.seq_len  # budget: one token
        alerts = [s for s in skew if "alert" in s]  # any real routing is above 1.01, from the first step on
        assert len(alerts) == 1 and alerts[0]["step"] == 1 and sorted(alerts[0]["layers"]) == ["0", "1"]
    assert losses["tight"] == pytest.approx(losses["roomy"], rel=1e-5)
