"""Gradient-accumulation fusion: the expert weights' gradients added to the optimizer's gradient buffers inside the
layer's backward (model.moe.grad_accumulation_fusion) give what autograd's own accumulation gives.

On CPU the Triton kernel runs under the interpreter (its accumulating epilogue; the TMA reads need sm90 and are
checked by the GPU test at the end)."""

from __future__ import annotations

import pytest
import torch
from helpers_gpu import host_has_gpu
from kernel_helpers import input_generator, random_idx, rel_err, run_compiled

from moe_launch.conf.schema import MoEConfig
from moe_launch.kernels import grouped_gemm
from moe_launch.kernels.index_gen import route_indices
from moe_launch.kernels.moe import fast_experts
from moe_launch.trainer.moe import layer as layer_mod


@pytest.fixture
def gen() -> torch.Generator:
    return input_generator()


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_wgrad_add_equals_old_plus_product(impl, gen):
    idx = random_idx(300, 4, 16, gen, range(3, 7))  # experts 3..6 get no rows: their gradient must stay as it was
    plan = route_indices(idx, 0, 16)
    a_NM, b_NK = torch.randn(1200, 24, generator=gen), torch.randn(1200, 40, generator=gen)
    old = torch.randn(16, 24, 40, generator=gen)
    out = old.clone()
    grouped_gemm.grouped_mm_wgrad_add_(out, a_NM, b_NK, plan, impl)
    want = old + grouped_gemm.grouped_mm_wgrad_reference(a_NM, b_NK, plan.offsets_E1)
    assert rel_err(out, want) <= 1e-6
    assert torch.equal(out[3:7], old[3:7])


def layer_grads(fuse: bool, params, x, idx, w, dy, passes: int, impl: str):
    for _ in range(passes):  # micro-batches accumulate into whatever .grad holds
        y = fast_experts(x, idx, w, *params, gemm_impl=impl, fuse_grad_accumulation=fuse)
        y.backward(dy)
    return [p.grad for p in params]


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fused_backward_adds_into_the_gradient_buffer(impl, gen):
    T, D, F, E, K = 64, 32, 16, 8, 2
    idx = random_idx(T, K, E, gen)
    x, dy = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
    w = torch.rand(T, K, generator=gen)
    weights = [torch.randn(E, F, D, generator=gen) * 0.1, torch.randn(E, F, D, generator=gen) * 0.1,
               torch.randn(E, D, F, generator=gen) * 0.1]
    start = [torch.randn(t.shape, generator=gen) for t in weights]  # what earlier micro-batches left in the buffers

    plain = [torch.nn.Parameter(t.clone()) for t in weights]
    for p, g in zip(plain, start):
        p.grad = g.clone()
    want = layer_grads(False, plain, x, idx, w, dy, 2, impl)

    flat = torch.cat([g.reshape(-1) for g in start])  # as the optimizer keeps them: views of one flat buffer
    fused = [torch.nn.Parameter(t.clone()) for t in weights]
    views, off = [], 0
    for p in fused:
        views.append(flat[off: off + p.numel()].view_as(p))
        off += p.numel()
        p.grad = views[-1]
    got = layer_grads(True, fused, x, idx, w, dy, 2, impl)
    for g, v, ref in zip(got, views, want):
        assert g is v  # the same buffer view, added to in place
        assert rel_err(g, ref) <= 1e-6


def test_without_a_gradient_buffer_autograd_accumulates(gen):
    """No .grad yet (the first backward without an optimizer, or torch.autograd.grad): nothing to add into."""
    T, D, F, E, K = 32, 16, 8, 4, 2
    idx = random_idx(T, K, E, gen)
    x = torch.randn(T, D, generator=gen)
    w = torch.rand(T, K, generator=gen)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in ((E, F, D), (E, F, D), (E, D, F))]
    y = fast_experts(x, idx, w, *ps, gemm_impl="triton", fuse_grad_accumulation=True)
    grads = torch.autograd.grad(y.sum(), ps)
    y2 = fast_experts(x, idx, w, *ps, gemm_impl="triton", fuse_grad_accumulation=False)
    for g, ref in zip(grads, torch.autograd.grad(y2.sum(), ps)):
        assert rel_err(g, ref) <= 1e-6


def test_the_config_flag_reaches_the_kernels():
    on = layer_mod.MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8, impl="fast", cuda_graph="false"))
    assert on.experts_fn.func is fast_experts and on.experts_fn.keywords == {"fuse_grad_accumulation": True}
    graphed = layer_mod.MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8, impl="fast"))
    assert graphed.experts_fn.func is fast_experts
    assert graphed.experts_fn.keywords == {"fuse_grad_accumulation": True, "graphs": graphed.expert_graphs}
    off = layer_mod.MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8, impl="fast",
                                           grad_accumulation_fusion=False, cuda_graph="false"))
    assert off.experts_fn is fast_experts
    auto = layer_mod.MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8))
    assert auto.experts_fn.func is layer_mod.auto_experts
    ref = layer_mod.MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8, impl="reference"))
    assert ref.experts_fn is layer_mod.experts_reference


@pytest.mark.skipif(not host_has_gpu(9), reason="needs an sm90 GPU (TMA reads)")
def test_tma_epilogue_add_on_the_gpu():
    """The compiled kernel (this folder's tests interpret Triton, which has no TMA): gpu_wgrad_add.py in a process
    without TRITON_INTERPRET."""
    out = run_compiled("gpu_wgrad_add.py")
    assert out.count("ok ") == 3, out
