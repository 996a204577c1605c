"""The CUDA-graphed expert stage (kernels/moe_graph.py) against the eager one on a GPU, compiled kernels: the same
kernels replayed must give bit-identical outputs and gradients, call after call with new tokens and new routing.
Run by test_moe_graph.py in a process without TRITON_INTERPRET; prints one "ok" line per case, exits non-zero on a
failure."""

from __future__ import annotations

import torch
import triton  # noqa: F401  (first: compiled mode)

from moe_launch.kernels.moe import fast_experts
from moe_launch.kernels.moe_graph import ExpertGraphs, expert_flops

T, D, F, E, K = 512, 256, 128, 16, 4


def _weights(seed: int, e_local: int = E):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * 0.05).cuda().bfloat16().requires_grad_()
            for s in ((e_local, F, D), (e_local, F, D), (e_local, D, F))]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).cuda().bfloat16().requires_grad_()
    logits = torch.randn(T, E, generator=g).cuda()
    w_TK, idx_TK = logits.softmax(-1).topk(K, dim=-1)
    return x, w_TK.requires_grad_(), idx_TK, torch.randn(T, D, generator=g).cuda().bfloat16()


def _run(ws, seed, graphs=None, fuse=False, e_start=0, gemm_impl="auto"):
    x, w_TK, idx_TK, dy = _inputs(seed)
    y = fast_experts(x, idx_TK, w_TK, *ws, e_start=e_start, fuse_grad_accumulation=fuse, graphs=graphs,
                     gemm_impl=gemm_impl)
    y.backward(dy)
    return [y.detach(), x.grad, w_TK.grad]


def _same(a, b, what):
    for i, (u, v) in enumerate(zip(a, b)):
        assert u is not None and v is not None and torch.equal(u, v), f"{what}: tensor {i} differs"


def calls_replay_bit_for_bit():
    ws_eager, ws_graph = _weights(0), _weights(0)
    graphs = ExpertGraphs()
    for call in range(5):  # warm, capture, then replays; every call new tokens and routing
        want = _run(ws_eager, seed=call)
        got = _run(ws_graph, seed=call, graphs=graphs)
        _same(got, want, f"call {call}")
        _same([w.grad for w in ws_graph], [w.grad for w in ws_eager], f"call {call} weight grads (accumulated)")
        assert len(graphs.graphs) == (0 if call == 0 else 1), (call, len(graphs.graphs))
    print("ok: 5 calls, new routing each, outputs and accumulated gradients bit-identical to eager")


def grads_into_buffers_and_a_local_expert_range():
    # 8 of the 16 experts live here (EP rank 1): pairs routed elsewhere contribute nothing
    ws_eager, ws_graph = _weights(1, e_local=8), _weights(1, e_local=8)
    for w in (*ws_eager, *ws_graph):
        w.grad = torch.zeros_like(w)
    bufs = [w.grad for w in ws_graph]
    graphs = ExpertGraphs()
    for call in range(4):
        want = _run(ws_eager, seed=10 + call, fuse=True, e_start=8)
        got = _run(ws_graph, seed=10 + call, graphs=graphs, fuse=True, e_start=8)
        _same(got, want, f"into-buffer call {call}")
        _same([w.grad for w in ws_graph], [w.grad for w in ws_eager], f"into-buffer call {call} buffers")
    assert all(w.grad is b for w, b in zip(ws_graph, bufs)) and len(graphs.graphs) == 1
    print("ok: gradients added into .grad buffers inside the replayed backward, experts 8..15, bit-identical")


def our_tma_kernels_replay_bit_for_bit():
    """gemm_impl="tma": the fused SwiGLU GEMMs and the persistent TMA GEMM make their TMA descriptors on the device,
    in scratch from torch's allocator: captured, that scratch comes from the graph's pool."""
    ws_eager, ws_graph = _weights(2), _weights(2)
    for w in (*ws_eager, *ws_graph):
        w.grad = torch.zeros_like(w)
    graphs = ExpertGraphs()
    for call in range(4):
        want = _run(ws_eager, seed=20 + call, fuse=True, gemm_impl="tma")
        got = _run(ws_graph, seed=20 + call, graphs=graphs, fuse=True, gemm_impl="tma")
        _same(got, want, f"tma call {call}")
        _same([w.grad for w in ws_graph], [w.grad for w in ws_eager], f"tma call {call} buffers")
    assert len(graphs.graphs) == 1
    print("ok: the fused SwiGLU GEMMs and our TMA GEMM replayed from graphs, bit-identical to eager")


def forwards_in_flight_take_a_graph_each():
    for max_graphs in (4, 1):  # room for a second graph; none (the second forward runs eager)
        _forwards_in_flight(max_graphs)
    print("ok: forwards in flight take a graph each, or run eager past the cap; a dropped forward frees its graph")


def _forwards_in_flight(max_graphs: int):
    ws_eager, ws_graph = _weights(2), _weights(2)
    graphs = ExpertGraphs(max_graphs=max_graphs)
    _run(ws_graph, seed=20, graphs=graphs)
    _run(ws_graph, seed=21, graphs=graphs)  # captured: the graph now exists
    _run(ws_eager, seed=20)
    _run(ws_eager, seed=21)
    outs = {}
    for name, ws, gr in (("eager", ws_eager, None), ("graph", ws_graph, graphs)):
        a, b = _inputs(22), _inputs(23)
        ya = fast_experts(a[0], a[2], a[1], *ws, graphs=gr)  # replayed: the graph is busy until ya's backward
        yb = fast_experts(b[0], b[2], b[1], *ws, graphs=gr)  # a second graph, or eager past the cap
        yb.backward(b[3])
        ya.backward(a[3])
        outs[name] = [ya.detach(), yb.detach(), a[0].grad, b[0].grad, a[1].grad, b[1].grad, *(w.grad for w in ws)]
    _same(outs["graph"], outs["eager"], f"two forwards in flight, max_graphs {max_graphs}")
    assert graphs.count() == min(2, max_graphs), graphs.count()
    # a forward whose backward never runs frees the graph once its autograd graph is gone
    x, w_TK, idx_TK, _ = _inputs(24)
    y = fast_experts(x, idx_TK, w_TK, *ws_graph, graphs=graphs)
    held = next(iter(graphs.graphs.values()))[0]
    assert held.busy
    del y
    assert not held.busy


def no_grad_and_retain_graph():
    ws_eager, ws_graph = _weights(3), _weights(3)
    graphs = ExpertGraphs()
    for seed in (30, 31):
        _run(ws_graph, seed=seed, graphs=graphs)
    x, w_TK, idx_TK, dy = _inputs(32)
    with torch.no_grad():
        y_graph = fast_experts(x, idx_TK, w_TK, *ws_graph, graphs=graphs)
        y_eager = fast_experts(x, idx_TK, w_TK, *ws_eager)
    assert torch.equal(y_graph, y_eager)
    held = next(iter(graphs.graphs.values()))[0]
    replays = held.gen
    got, want = [], []
    for ws, gr, out in ((ws_graph, graphs, got), (ws_eager, None, want)):
        for w in ws:
            w.grad = None
        xx = x.detach().requires_grad_()
        y = fast_experts(xx, idx_TK, w_TK.detach().requires_grad_(), *ws, graphs=gr)
        y.backward(dy, retain_graph=True)
        y.backward(dy)  # twice: gradients add up, the saved state is still there
        out += [xx.grad, *(w.grad for w in ws)]
    _same(got, want, "backward twice with retain_graph")
    assert held.gen == replays + 1, "the retain_graph case did not replay the graph"
    # a new forward between the two backwards overwrites the saved state: refused, not silently wrong
    xx = x.detach().requires_grad_()
    y = fast_experts(xx, idx_TK, w_TK.detach().requires_grad_(), *ws_graph, graphs=graphs)
    y.backward(dy, retain_graph=True)
    _run(ws_graph, seed=33, graphs=graphs)
    try:
        y.backward(dy)
    except RuntimeError as e:
        assert "ran another forward before this backward" in str(e), e
    else:
        raise AssertionError("a backward after another forward replayed was not refused")
    print("ok: no_grad runs eager and equal; backward twice with retain_graph equal; a stale backward refused")


def under_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    ws_eager, ws_graph = _weights(5), _weights(5)
    graphs = ExpertGraphs()
    for seed in (50, 51):  # captured
        _run(ws_graph, seed=seed, graphs=graphs)
        _run(ws_eager, seed=seed)
    held = next(iter(graphs.graphs.values()))[0]
    replays = held.gen
    outs = []
    for ws, gr in ((ws_eager, None), (ws_graph, graphs)):
        x, w_TK, idx_TK, dy = _inputs(52)
        y = checkpoint(lambda a, b, i=idx_TK, gr=gr, ws=ws: fast_experts(a, i, b, *ws, graphs=gr), x, w_TK,
                       use_reentrant=False)
        y.backward(dy)
        outs.append([y.detach(), x.grad, w_TK.grad, *(w.grad for w in ws)])
    _same(outs[1], outs[0], "under checkpoint")
    assert held.gen == replays, "a checkpointed call replayed the graph"
    print("ok: under activation checkpointing the call runs eager, equal")


def signature_cap():
    ws = _weights(4)
    graphs = ExpertGraphs(max_graphs=1)
    for seed in (40, 41, 42):
        _run(ws, seed=seed, graphs=graphs)
    global T
    t0, T = T, 256  # a second shape: past the cap, eager
    try:
        for seed in (43, 44, 45):
            _run(ws, seed=seed, graphs=graphs)
    finally:
        T = t0
    assert graphs.count() == 1, graphs.count()
    # fp32 master weights under autocast: cast to new bf16 tensors in every call, so nothing to capture
    ws32 = [w.detach().float().requires_grad_() for w in _weights(6)]
    graphs32 = ExpertGraphs()
    for seed in (60, 61, 62):
        x, w_TK, idx_TK, dy = _inputs(seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fast_experts(x, idx_TK, w_TK, *ws32, graphs=graphs32)
        y.backward(dy)
    assert not graphs32.graphs and not graphs32.seen and ws32[0].grad.dtype == torch.float32
    print("ok: past max_graphs a new shape runs eager; weights cast per call are never captured")


def size_bound():
    """model.moe.cuda_graph=auto's bound: a call within it is captured and replayed bit for bit, one above it never."""
    global T
    ws_eager, ws_graph = _weights(7), _weights(7)
    graphs = ExpertGraphs(max_flops=expert_flops(T, K, D, F))
    for call in range(3):
        _same(_run(ws_graph, seed=70 + call, graphs=graphs), _run(ws_eager, seed=70 + call), f"bounded call {call}")
    assert graphs.count() == 1, graphs.count()
    t0, T = T, T + 64
    try:
        for call in range(3):
            _same(_run(ws_graph, seed=80 + call, graphs=graphs), _run(ws_eager, seed=80 + call), f"large call {call}")
    finally:
        T = t0
    assert graphs.count() == 1 and len(graphs.seen) == 1, (graphs.count(), graphs.seen)
    _same([w.grad for w in ws_graph], [w.grad for w in ws_eager], "bounded calls' weight grads (accumulated)")
    print("ok: a call within the size bound replays bit for bit; one above it runs eager and is never captured")


if __name__ == "__main__":
    calls_replay_bit_for_bit()
    grads_into_buffers_and_a_local_expert_range()
    our_tma_kernels_replay_bit_for_bit()
    forwards_in_flight_take_a_graph_each()
    no_grad_and_retain_graph()
    under_activation_checkpointing()
    signature_cap()
    size_bound()
