"""fast_experts (FastSparseMoE) equals trainer.moe.reference.experts_reference: forward and every gradient.

fp32 on the CPU under Triton's interpreter; tolerance 1e-5 relative L2 error (for the routing weights' gradient,
relative to the size of its terms). Cases cover one expert, a rank owning a sub-range of the experts (tokens whose
experts are all remote get y = 0), experts with zero tokens, top-k 1..8, and 4096 tokens at a tiny hidden size.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import input_generator, random_idx, rel_err

from moe_launch.conf.schema import MoEConfig
from moe_launch.kernels.moe import fast_experts
from moe_launch.trainer.moe.layer import MoELayer
from moe_launch.trainer.moe.reference import experts_reference

# (T, D, F, local experts, global experts, e_start, K, experts never chosen)
CASES = [
    (1, 8, 16, 1, 1, 0, 1, range(0)),
    (64, 32, 16, 8, 12, 2, 3, range(0)),
    (300, 16, 32, 16, 16, 0, 8, range(0)),
    (200, 24, 16, 16, 64, 32, 8, range(36, 44)),
    (4096, 8, 16, 64, 64, 0, 8, range(0)),
]


def _inputs(T, D, Fh, E, EG, K, skip, gen):
    x = torch.randn(T, D, generator=gen)
    w_TK = torch.rand(T, K, generator=gen)
    wg = torch.randn(E, Fh, D, generator=gen) / D**0.5
    wu = torch.randn(E, Fh, D, generator=gen) / D**0.5
    wd = torch.randn(E, D, Fh, generator=gen) / Fh**0.5
    return random_idx(T, K, EG, gen, skip), [x, w_TK, wg, wu, wd]


def _run(fn, idx, tensors, e_start, dy):
    ps = [t.clone().requires_grad_() for t in tensors]
    y = fn(ps[0], idx, ps[1], *ps[2:], e_start=e_start)
    return [y.detach(), *torch.autograd.grad(y, ps, dy)]


def _term_sizes_TK(idx, tensors, e_start, dy):
    """[T, K] sum over d of |dy[t, d] * out[t, k, d]|, out the pair's expert output: the size of the terms of the
    routing weight's gradient dw[t, k] = dy[t] . out[t, k]. Its fp32 rounding error scales with them, and where they
    cancel (one token, D = 8) it is many times the sum's own relative precision."""
    x, _, *weights = tensors
    ones_T1 = torch.ones(x.shape[0], 1)
    out_TKD = torch.stack([experts_reference(x, idx[:, k : k + 1], ones_T1, *weights, e_start=e_start)
                           for k in range(idx.shape[1])], dim=1)
    return (dy.abs()[:, None, :] * out_TKD.abs()).sum(-1)


@pytest.mark.parametrize("T,D,Fh,E,EG,e0,K,skip", CASES)
def test_forward_and_all_gradients_match_reference(T, D, Fh, E, EG, e0, K, skip):
    gen = input_generator()
    idx, tensors = _inputs(T, D, Fh, E, EG, K, skip, gen)
    dy = torch.randn(T, D, generator=gen)
    got = _run(fast_experts, idx, tensors, e0, dy)
    want = _run(experts_reference, idx, tensors, e0, dy)
    for name, a, b in zip(("y", "dx", "dw_TK", "dw_gate", "dw_up", "dw_down"), got, want):
        if b.abs().max() == 0:  # e.g. a rank that owns no routed expert: all exactly zero
            assert bool((a == 0).all()), name
        elif name == "dw_TK":
            scale = _term_sizes_TK(idx, tensors, e0, dy).norm()
            assert ((a - b).norm() / scale).item() <= 1e-5, name
        else:
            assert rel_err(a, b) <= 1e-5, name


def test_deterministic_and_partial_grads():
    """Bitwise-repeatable results (no atomics), and inputs that need no gradient get none."""
    gen = torch.Generator().manual_seed(7)
    idx, (x, w_TK, wg, wu, wd) = _inputs(50, 16, 8, 4, 4, 2, range(0), gen)
    wg.requires_grad_()
    y1 = fast_experts(x, idx, w_TK, wg, wu, wd)
    (g1,) = torch.autograd.grad(y1.sum(), wg)
    y2 = fast_experts(x, idx, w_TK, wg, wu, wd)
    (g2,) = torch.autograd.grad(y2.sum(), wg)
    assert torch.equal(y1, y2) and torch.equal(g1, g2)


def test_trainer_layer_fast_equals_reference():
    """model.moe.impl=fast in the trainer's MoELayer: same output and parameter gradients as impl=reference."""
    torch.manual_seed(0)
    layers = [MoELayer(16, MoEConfig(num_experts=8, top_k=2, expert_hidden=32, impl=impl)) for impl in
              ("reference", "fast")]
    for p in layers[0].parameters():
        torch.nn.init.normal_(p, std=0.2)
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(3, 20, 16)
    outs = []
    for layer in layers:
        y, stats = layer(x)
        (y.square().sum() + stats.aux_loss).backward()
        outs.append((y.detach(), {n: p.grad for n, p in layer.named_parameters()}))
    assert rel_err(outs[1][0], outs[0][0]) <= 1e-5
    for n, g in outs[0][1].items():
        assert rel_err(outs[1][1][n], g) <= 1e-5, n


def test_autocast_runs_in_low_precision_and_returns_fp32_grads():
    """Under torch.autocast the experts compute in bf16 (y is bf16) and fp32 master weights get fp32 gradients.
    Compared with an fp32 evaluation on the bf16-rounded inputs. The bound is loose because Triton's CPU interpreter
    converts to bf16 more crudely than a GPU does (on the H200, benchmarks/moe_layer.py measures ~5e-3)."""
    gen = torch.Generator().manual_seed(3)
    idx, tensors = _inputs(50, 16, 32, 4, 4, 2, range(0), gen)
    ps = [t.clone().requires_grad_() for t in tensors]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fast_experts(ps[0], idx, ps[1], *ps[2:])
    grads = torch.autograd.grad(y.float().sum(), ps)
    assert y.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads)
    rounded = [t.bfloat16().float() if i != 1 else t for i, t in enumerate(tensors)]
    want = _run(experts_reference, idx, rounded, 0, torch.ones(50, 16))
    assert rel_err(y.float(), want[0]) <= 5e-2
    for g, w in zip(grads, want[1:]):
        assert rel_err(g, w) <= 5e-2


def test_no_tokens():
    """An EP rank may receive no tokens at all: empty output, zero weight gradients."""
    gen = torch.Generator().manual_seed(5)
    idx, tensors = _inputs(0, 8, 16, 4, 4, 2, range(0), gen)
    got = _run(fast_experts, idx, tensors, 0, torch.zeros(0, 8))
    assert got[0].shape == (0, 8) and all(bool((g == 0).all()) for g in got[3:])


def test_non_contiguous_inputs():
    """Transposed views for x and the router weights (as a dispatcher may hand over) give the same result."""
    gen = torch.Generator().manual_seed(11)
    idx, (x, w_TK, wg, wu, wd) = _inputs(40, 8, 16, 6, 6, 3, range(0), gen)
    x_view, w_view = x.t().contiguous().t(), w_TK.t().contiguous().t()
    assert not x_view.is_contiguous() and not w_view.is_contiguous()
    got = _run(fast_experts, idx, [x_view, w_view, wg, wu, wd], 0, torch.ones(40, 8))
    want = _run(experts_reference, idx, [x, w_TK, wg, wu, wd], 0, torch.ones(40, 8))
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-5
