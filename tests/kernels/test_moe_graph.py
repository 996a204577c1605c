"""CUDA graphs of the expert stage (kernels/moe_graph.py): when a call may replay a graph (graph_action, pure), what
a graph bakes in (signature), that off CUDA a layer with graphs is the eager layer, and the config that turns them
on. Capture and replay themselves need a GPU: gpu_moe_graph.py checks them bit for bit against eager."""

from __future__ import annotations

import pytest
import torch
from helpers_gpu import host_has_gpu
from kernel_helpers import run_compiled

from moe_launch.conf.schema import MoEConfig
from moe_launch.errors import ConfigError
from moe_launch.kernels.moe import fast_experts
from moe_launch.kernels.moe_graph import (
    AUTO_MAX_FLOPS,
    CAPTURE,
    EAGER,
    REPLAY,
    WARM,
    CallShape,
    ExpertGraphs,
    expert_flops,
    graph_action,
    signature,
)
from moe_launch.trainer.moe import layer as layer_mod

GRAPHABLE = CallShape(on_cuda=True, precision="bf16", grad_wanted=True, compiling=False, capturing=False,
                      saved_tensor_hooks=False)


def _action(call=GRAPHABLE, held=False, free=False, seen=0, graphs=0, max_graphs=4, max_flops=None):
    return graph_action(call, held, free, seen, graphs, max_graphs, max_flops)


def test_first_call_warms_second_captures_then_replays():
    assert _action(seen=0) == WARM
    assert _action(seen=1) == CAPTURE
    assert _action(held=True, free=True, seen=1, graphs=1) == REPLAY


def test_forwards_in_flight_take_a_graph_each_up_to_the_cap():
    # every graph of the signature holds a forward whose backward is still to run (a 1F1B stage's micro-batches)
    assert _action(held=True, free=False, graphs=1) == CAPTURE
    assert _action(held=True, free=False, graphs=3) == CAPTURE
    assert _action(held=True, free=False, graphs=4) == EAGER


@pytest.mark.parametrize("change", [dict(on_cuda=False), dict(precision="fp8"), dict(grad_wanted=False),
                                    dict(compiling=True), dict(capturing=True), dict(saved_tensor_hooks=True)])
def test_calls_a_graph_cannot_serve_run_eager(change):
    call = CallShape(**{**GRAPHABLE.__dict__, **change})
    assert _action(call=call, held=True, free=True) == EAGER
    assert _action(call=call, seen=5) == EAGER


def test_a_size_bound_leaves_larger_calls_eager_and_smaller_ones_as_before():
    big = CallShape(**{**GRAPHABLE.__dict__, "flops": 2e12})
    small = CallShape(**{**GRAPHABLE.__dict__, "flops": 1e12})
    assert _action(call=big, seen=5, max_flops=1.5e12) == EAGER
    assert _action(call=big, held=True, free=True, max_flops=1.5e12) == EAGER
    for kw in (dict(seen=0), dict(seen=1), dict(held=True, free=True, graphs=1), dict(held=True, graphs=4)):
        assert _action(call=small, max_flops=1.5e12, **kw) == _action(call=small, **kw)  # at the bound: graphable
        assert _action(call=big, **kw) == _action(call=small, **kw)  # no bound: any size


def test_auto_bound_graphs_the_token_counts_where_graphs_were_measured_to_gain():
    # OLMoE dims: 1k and 2k tokens per call gained (1.66x, 1.12x), 3k and 4k did not (benchmarks/RESULTS.md)
    assert expert_flops(1024, 8, 2048, 1024) <= expert_flops(2048, 8, 2048, 1024) <= AUTO_MAX_FLOPS
    assert AUTO_MAX_FLOPS < expert_flops(3000, 8, 2048, 1024) < expert_flops(4096, 8, 2048, 1024)
    # three GEMMs of 2*D*F per row, each run forward, for the activation gradient and for the weight gradient
    assert expert_flops(3, 2, 5, 7) == 3 * 3 * 2 * 5 * 7 * (3 * 2)


def test_a_call_above_the_bound_is_never_counted_nor_captured(monkeypatch):
    import dataclasses

    from moe_launch.kernels import moe_graph

    captures = []
    real = moe_graph.graph_action
    monkeypatch.setattr(moe_graph, "graph_action", lambda call, *rest: real(dataclasses.replace(call, on_cuda=True),
                                                                            *rest))
    def capture(*args, **kwargs):  # a capture attempt is what is counted; the layer then goes on eager
        captures.append(1)
        raise RuntimeError("no capture on CPU")

    monkeypatch.setattr(moe_graph, "_Captured", capture)
    x, w_TK, idx_TK, ws = _call_args(T=8, D=16, F=8, K=2)
    graphs = ExpertGraphs(max_flops=expert_flops(8, 2, 16, 8) - 1)  # the bound just below this call
    for _ in range(3):
        fast_experts(x, idx_TK, w_TK, *ws, graphs=graphs).sum().backward()
    assert not captures and not graphs.seen and not graphs.graphs
    graphs = ExpertGraphs(max_flops=expert_flops(8, 2, 16, 8))  # at the bound: warmed, then captured
    fast_experts(x, idx_TK, w_TK, *ws, graphs=graphs)
    assert list(graphs.seen.values()) == [1] and not captures
    fast_experts(x, idx_TK, w_TK, *ws, graphs=graphs)
    assert captures == [1]


def test_no_new_capture_past_max_graphs_but_held_graphs_still_replay():
    assert _action(seen=3, graphs=4, max_graphs=4) == EAGER
    assert _action(seen=0, graphs=4, max_graphs=4) == EAGER
    assert _action(held=True, free=True, graphs=4, max_graphs=4) == REPLAY


def test_activation_checkpointing_is_seen_in_both_of_its_passes():
    from torch.utils.checkpoint import checkpoint

    from moe_launch.kernels.moe_graph import saved_tensor_hooks_active

    seen = []

    def region(x):
        seen.append(saved_tensor_hooks_active())
        return x * x  # saves x: the backward recomputes

    assert not saved_tensor_hooks_active()
    x = torch.ones(3, requires_grad=True)
    checkpoint(region, x, use_reentrant=False).sum().backward()
    assert seen == [True, True]  # the forward and the recompute in the backward


def _call_args(T=8, D=16, F=8, E=4, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    w_TK = torch.rand(T, K, generator=g, requires_grad=True)
    idx_TK = torch.randint(0, E, (T, K), generator=g)
    ws = [torch.randn(*s, generator=g, requires_grad=True) for s in ((E, F, D), (E, F, D), (E, D, F))]
    return x, w_TK, idx_TK, ws


def test_signature_holds_what_a_graph_bakes_in():
    x, w_TK, idx_TK, ws = _call_args()
    need, into = (True,) * 5, (None,) * 3
    base = signature(x, w_TK, idx_TK, ws, 0, "auto", need, into)
    x2, w2, i2, _ = _call_args(seed=1)  # other values, same shapes and weights: the same graph serves
    assert signature(x2, w2, i2, ws, 0, "auto", need, into) == base
    other_ws = [w.detach().clone() for w in ws]  # same shapes, other storage: the graph reads by address
    assert signature(x, w_TK, idx_TK, other_ws, 0, "auto", need, into) != base
    assert signature(x[:4], w_TK[:4], idx_TK[:4], ws, 0, "auto", need, into) != base
    assert signature(x, w_TK, idx_TK, ws, 2, "auto", need, into) != base
    assert signature(x, w_TK, idx_TK, ws, 0, "auto", (True, False, True, True, True), into) != base
    bufs = tuple(torch.zeros_like(w) for w in ws)  # gradients added into buffers, by address
    assert signature(x, w_TK, idx_TK, ws, 0, "auto", need, bufs) != base
    assert signature(x, w_TK, idx_TK, ws, 0, "auto", need, bufs) == signature(x, w_TK, idx_TK, ws, 0, "auto", need,
                                                                              bufs)


def test_off_cuda_a_layer_with_graphs_is_the_eager_layer():
    graphs = ExpertGraphs()
    outs = []
    for gr in (None, graphs, graphs):
        x, w_TK, idx_TK, ws = _call_args(seed=3)
        y = fast_experts(x, idx_TK, w_TK, *ws, graphs=gr)
        y.backward(torch.ones_like(y))
        outs.append([y.detach(), x.grad, w_TK.grad, *(w.grad for w in ws)])
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))
    assert not graphs.graphs and not graphs.seen


def test_a_failed_capture_leaves_the_layer_eager_and_says_so(monkeypatch, caplog):
    import dataclasses

    from moe_launch.kernels import moe_graph

    attempts = []

    def fail(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    # the decisions of a CUDA call, on CPU tensors; the capture itself fails
    real = moe_graph.graph_action
    monkeypatch.setattr(moe_graph, "graph_action", lambda call, *rest: real(dataclasses.replace(call, on_cuda=True),
                                                                            *rest))
    monkeypatch.setattr(moe_graph, "_Captured", fail)
    _, _, _, ws = _call_args(seed=4)
    graphs = ExpertGraphs()
    outs = {None: [], "graphs": []}
    with caplog.at_level("WARNING", logger=moe_graph.LOG.name):
        for call in range(4):  # warm-up, failed capture, then eager for good
            for key, gr in ((None, None), ("graphs", graphs)):
                x, w_TK, idx_TK, _ = _call_args(seed=10 + call)
                y = fast_experts(x, idx_TK, w_TK, *ws, graphs=gr)
                y.backward(torch.ones_like(y))
                outs[key] += [y.detach(), x.grad, w_TK.grad]
    assert all(torch.equal(a, b) for a, b in zip(outs["graphs"], outs[None]))
    assert len(attempts) == 1 and graphs.max_graphs == 0 and not graphs.graphs
    assert sum("capturing the expert stage as a CUDA graph failed" in r.message for r in caplog.records) == 1


def test_config_binds_one_graph_set_per_layer():
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, cuda_graph=True)
    a, b = layer_mod.MoELayer(16, cfg), layer_mod.MoELayer(16, cfg)
    assert isinstance(a.expert_graphs, ExpertGraphs) and a.expert_graphs is not b.expert_graphs
    assert a.experts_fn.keywords["graphs"] is a.expert_graphs and a.expert_graphs.max_flops is None
    off = layer_mod.MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8, cuda_graph=False))
    assert off.expert_graphs is None and "graphs" not in getattr(off.experts_fn, "keywords", {})


def test_default_graphs_small_calls_of_the_bf16_kernels_only():
    auto = layer_mod.MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8))
    assert auto.expert_graphs.max_flops == AUTO_MAX_FLOPS
    for other in (dict(impl="reference"), dict(precision="fp8")):  # auto there means none, not an error
        cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, **other)
        assert cfg.cuda_graph == "auto" and layer_mod.expert_graphs(cfg) is None


def test_default_leaves_the_alltoall_dispatchers_varying_shapes_eager():
    def graphs(ep_size, **kw):
        return layer_mod.expert_graphs(MoEConfig(num_experts=4, top_k=2, expert_hidden=8, **kw), ep_size)

    assert graphs(2, dispatcher="alltoall") is None
    assert graphs(2, dispatcher="allgather").max_flops == AUTO_MAX_FLOPS  # every rank gets all tokens: fixed shapes
    assert graphs(1, dispatcher="alltoall").max_flops == AUTO_MAX_FLOPS  # ep=1 dispatches locally
    assert graphs(2, dispatcher="alltoall", cuda_graph=True).max_flops is None  # asked for: graphed where it can be
    layer = layer_mod.MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8, dispatcher="alltoall"),
                               ep_rank=1, ep_size=2)
    assert layer.expert_graphs is None and "graphs" not in getattr(layer.experts_fn, "keywords", {})


@pytest.mark.parametrize("given,stored", [(True, "true"), (False, "false"), ("True", "true"), ("AUTO", "auto")])
def test_cuda_graph_takes_hydra_booleans(given, stored):
    assert MoEConfig(num_experts=4, top_k=2, expert_hidden=8, cuda_graph=given).cuda_graph == stored


def test_cuda_graph_override_through_hydra():
    from hydra import compose, initialize
    from omegaconf import OmegaConf

    from moe_launch.conf.store import register

    register()
    with initialize(version_base=None, config_path=None):
        for override, stored in (("model.moe.cuda_graph=true", "true"), ("model.moe.cuda_graph=false", "false"),
                                 ("model.moe.cuda_graph=auto", "auto")):
            cfg = OmegaConf.to_object(compose("moe_launch", overrides=[override]))
            assert cfg.model.moe.cuda_graph == stored


@pytest.mark.parametrize("bad", [dict(impl="reference"), dict(precision="fp8")])
def test_cuda_graph_outside_the_bf16_kernels_is_refused(bad):
    with pytest.raises(ConfigError, match="model.moe.cuda_graph"):
        MoEConfig(num_experts=4, top_k=2, expert_hidden=16, cuda_graph=True, **bad)


def test_unknown_cuda_graph_value_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match="model.moe.cuda_graph.*auto, true, false"):
        MoEConfig(num_experts=4, top_k=2, expert_hidden=8, cuda_graph="yes")


@pytest.mark.skipif(not host_has_gpu(), reason="needs a CUDA GPU (capture and replay)")
def test_graphs_replay_bit_for_bit_on_the_gpu():
    """gpu_moe_graph.py in a process without TRITON_INTERPRET (this folder's tests interpret Triton)."""
    out = run_compiled("gpu_moe_graph.py")
    assert out.count("ok: ") == 8, out
