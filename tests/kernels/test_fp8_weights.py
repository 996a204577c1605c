"""The expert weights' FP8 operands (kernels/fp8_weights.py): quantizing into part of a larger operand, the fused
gate-up operand, reuse within a scope (same results bit for bit, each weight quantized once, re-quantized after an
in-place update, only the orientations asked for), and the trainer's choice of scope. CPU: Triton's interpreter for
the quantization, the fp32 emulation for the GEMMs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_helpers import random_idx

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.kernels import fp8, swiglu
from moe_launch.kernels.fp8_weights import _SCOPES, BACKWARD, FORWARD, ExpertOperands, operands_to_reuse, reuse_weights
from moe_launch.kernels.moe import fast_experts
from moe_launch.trainer.moe.layer import expert_weight_scope


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == fp8.E4M3 else t


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_quantize_rows_into_part_of_a_larger_operand(impl):
    gen = torch.Generator().manual_seed(0)
    x_ERC = (torch.randn(3, 20, 40, generator=gen) * torch.logspace(-3, 2, 20)[:, None]).bfloat16()
    q_big = torch.zeros(3, 50, 40, dtype=fp8.E4M3)
    s_big = torch.full((3, 50), -1.0)
    q, s = fp8.quantize_rows(x_ERC, impl=impl, out=(q_big[:, 10:30], s_big[:, 10:30]))
    q_want, s_want = fp8.quantize_rows(x_ERC, impl=impl)
    assert q.data_ptr() == q_big[:, 10:30].data_ptr()
    assert torch.equal(_bits(q_big[:, 10:30]), _bits(q_want)) and torch.equal(s_big[:, 10:30], s_want)
    assert bool((q_big[:, :10].float() == 0).all()) and bool((s_big[:, 30:] == -1).all())  # nothing else written


def test_quantize_rows_refuses_an_out_that_does_not_fit():
    x = torch.randn(4, 8).bfloat16()
    for q, s in ((torch.empty(4, 9, dtype=fp8.E4M3), torch.empty(4)),
                 (torch.empty(4, 8, dtype=fp8.E4M3), torch.empty(4, dtype=torch.float64)),
                 (torch.empty(8, 4, dtype=fp8.E4M3).t(), torch.empty(4))):
        with pytest.raises(ValueError, match="out"):
            fp8.quantize_rows(x, out=(q, s))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("strided", [False, True])
def test_a_tail_quantizes_the_concatenated_rows_without_concatenating(impl, strided):
    gen = torch.Generator().manual_seed(5)
    x, t = (torch.randn(2, 30, c, generator=gen) * torch.logspace(-4, 2, 30)[:, None] for c in (24, 40))
    t[:, 3] *= 1e4  # rows whose amax sits in the tail
    x, t = x.bfloat16(), t.bfloat16()
    if strided:  # channels of weights: rows strided, as the input-gradient operand reads them
        x, t = x.transpose(1, 2).contiguous().transpose(1, 2), t.transpose(1, 2).contiguous().transpose(1, 2)
    num_rows = torch.tensor(30, dtype=torch.int32)
    q, s = fp8.quantize_rows(x, num_rows, impl=impl, tail=t)
    q_want, s_want = fp8.quantize_rows_reference(torch.cat([x, t], -1))
    assert q.shape == (2, 30, 64) and torch.equal(_bits(q), _bits(q_want)) and torch.equal(s, s_want)
    with pytest.raises(ValueError, match="tail"):
        fp8.quantize_rows(x, impl=impl, tail=t[:, :29])


def test_gate_up_operand_is_both_projections_side_by_side():
    gen = torch.Generator().manual_seed(1)
    w_gate, w_up = (torch.randn(4, 24, 32, generator=gen) * s for s in (1.0, 1e-3))
    q, s = ExpertOperands(w_gate, w_up, torch.randn(4, 32, 24)).gate_up()
    assert q.shape == (4, 32, 48) and q.stride(1) == 1  # the b operand [E, D, 2F], column-major
    for half, w in ((slice(0, 24), w_gate), (slice(24, 48), w_up)):
        q_want, s_want = fp8.quantize_operand(w.transpose(1, 2))
        assert torch.equal(_bits(q[:, :, half]), _bits(q_want)) and torch.equal(s[:, half], s_want)


def test_input_gradient_operand_scales_each_channel_over_both_projections():
    gen = torch.Generator().manual_seed(6)
    w_gate, w_up = torch.randn(4, 24, 32, generator=gen), torch.randn(4, 24, 32, generator=gen) * 1e3
    q, s = ExpertOperands(w_gate, w_up, torch.randn(4, 32, 24)).gate_up_t()
    q_want, s_want = fp8.quantize_operand(torch.cat([w_gate, w_up], dim=1))  # b operand [E, 2F, D]
    assert q.shape == (4, 48, 32) and torch.equal(_bits(q), _bits(q_want)) and torch.equal(s, s_want)


def test_operands_to_reuse():
    assert operands_to_reuse(1, False) == {}
    assert operands_to_reuse(1, True) == {"gate_up": 2, "down": 2}
    assert operands_to_reuse(4, False) == {"gate_up": 4, "down": 4, "down_t": 4, "gate_up_t": 4}
    assert operands_to_reuse(2, True) == {"gate_up": 4, "down": 4, "down_t": 2, "gate_up_t": 2}
    assert tuple(operands_to_reuse(3, True)) == FORWARD + BACKWARD


def _layer_inputs(gen, T=96, D=32, Fh=24, E=8, K=2, dtype=torch.float32):
    idx = random_idx(T, K, E, gen, range(0))
    x = torch.randn(T, D, generator=gen).bfloat16()
    w_TK = torch.rand(T, K, generator=gen)
    ws = [(torch.randn(E, Fh, D, generator=gen) / 6).to(dtype).requires_grad_(),
          (torch.randn(E, Fh, D, generator=gen) / 6).to(dtype).requires_grad_(),
          (torch.randn(E, D, Fh, generator=gen) / 5).to(dtype).requires_grad_()]
    return idx, x, w_TK, ws, torch.randn(T, D, generator=gen).bfloat16()


def _pass(idx, x, w_TK, ws, dy):
    """One micro-batch: forward and backward, weight gradients accumulated into .grad; returns (y, dx)."""
    x = x.clone().requires_grad_()
    y = fast_experts(x, idx, w_TK, *ws, gemm_impl="reference", precision="fp8")
    y.backward(dy)
    return y.detach(), x.grad


def test_reuse_within_a_scope_gives_the_same_bits_and_quantizes_each_weight_once():
    idx, x, w_TK, ws, dy = _layer_inputs(torch.Generator().manual_seed(2))
    fresh = [_pass(idx, x, w_TK, ws, dy) for _ in range(3)]
    grads_fresh = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None
    with reuse_weights() as scope:
        reused = [_pass(idx, x, w_TK, ws, dy) for _ in range(3)]
    assert (scope.misses, scope.hits) == (4, 8)  # gate_up, down, down_t, gate_up_t: once, then twice reused
    assert not scope.entries  # released with the scope
    for (y0, dx0), (y1, dx1) in zip(fresh, reused):
        assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for g0, w in zip(grads_fresh, ws):
        assert w.grad.dtype == torch.float32 and torch.equal(g0, w.grad)  # master weights keep their dtype


def test_an_in_place_update_inside_a_scope_is_quantized_again():
    idx, x, w_TK, ws, dy = _layer_inputs(torch.Generator().manual_seed(3), dtype=torch.bfloat16)
    with reuse_weights() as scope:
        _pass(idx, x, w_TK, ws, dy)
        with torch.no_grad():
            ws[1].mul_(-2.0)  # w_up: gate_up and gate_up_t are stale, down and down_t stay valid
        y_scoped, dx_scoped = _pass(idx, x, w_TK, ws, dy)
    assert (scope.misses, scope.hits) == (4 + 2, 2)
    y_fresh, dx_fresh = _pass(idx, x, w_TK, ws, dy)
    assert torch.equal(y_scoped, y_fresh) and torch.equal(dx_scoped, dx_fresh)


def test_only_the_orientations_asked_for_are_kept():
    idx, x, w_TK, ws, dy = _layer_inputs(torch.Generator().manual_seed(4))
    with reuse_weights(FORWARD) as scope:
        _pass(idx, x, w_TK, ws, dy)
        _pass(idx, x, w_TK, ws, dy)
    assert (scope.misses, scope.hits) == (2, 2)
    assert {k[0] for k in scope.entries} <= set(FORWARD)
    with pytest.raises(ValueError, match="unknown"):
        with reuse_weights(("gate",)):
            pass
    with reuse_weights(()) as none:
        assert none is None


def test_the_trainer_opens_a_reuse_scope_only_where_a_step_quantizes_a_weight_twice():
    fp8_moe = ModelConfig(moe=MoEConfig(precision="fp8"))
    assert expert_weight_scope(ModelConfig(), 4, []) is contextlib.nullcontext  # bf16
    assert expert_weight_scope(ModelConfig(kind="dense"), 4, []) is contextlib.nullcontext
    assert expert_weight_scope(ModelConfig(moe=MoEConfig(precision="fp8", fp8_weight_reuse=False)), 4, []) \
        is contextlib.nullcontext
    assert expert_weight_scope(fp8_moe, 1, ["attention"]) is contextlib.nullcontext  # one pass, nothing recomputed
    for passes, recompute, keep in ((1, ["moe"], FORWARD), (1, ["full"], FORWARD), (2, [], FORWARD + BACKWARD)):
        with expert_weight_scope(fp8_moe, passes, recompute)() as scope:
            assert scope.keep == keep and scope.uses == operands_to_reuse(passes, bool(recompute))


def _forward_backward_of_layers(layers, dy, held_after_forward):
    """One micro-batch through a stack of expert layers (each its own weights); records the scope's held bytes
    between the forward and the backward, where a step's activations peak."""
    x = layers[0][1].clone().requires_grad_()
    y = x
    for idx, _, w_TK, ws in layers:
        y = fast_experts(y, idx, w_TK, *ws, gemm_impl="reference", precision="fp8")
    held_after_forward.append(_SCOPES[-1].held_bytes)
    y.backward(dy)
    return y.detach(), x.grad


def test_operands_are_dropped_at_their_last_use_in_the_step():
    gen = torch.Generator().manual_seed(8)
    layers = []
    for _ in range(3):
        idx, x, w_TK, ws, dy = _layer_inputs(gen)
        layers.append((idx, x, w_TK, ws))
    results, helds, scopes = [], [], []
    for keep in (FORWARD + BACKWARD, operands_to_reuse(2, False)):
        held: list[int] = []
        with reuse_weights(keep) as scope:
            out = [_forward_backward_of_layers(layers, dy, held) for _ in range(2)]
            left = len(scope.entries)
        results.append(out)
        helds.append(held)
        scopes.append((scope, left))
    (keep_all, left_all), (dropping, left_dropping) = scopes
    assert (dropping.misses, dropping.hits) == (keep_all.misses, keep_all.hits) == (12, 12)  # each built once
    for (y0, dx0), (y1, dx1) in zip(*results):
        assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    forward_bytes, both_bytes = helds[0]
    assert helds[1] == [forward_bytes, both_bytes - forward_bytes]  # the last forward let its operands go
    assert left_all == 12 and left_dropping == 0 and dropping.held_bytes == keep_all.held_bytes == 0
    assert keep_all.peak_bytes == dropping.peak_bytes == both_bytes  # all four, after the first backward


def test_a_lookup_after_the_last_announced_use_quantizes_again():
    idx, x, w_TK, ws, dy = _layer_inputs(torch.Generator().manual_seed(9))
    fresh = _pass(idx, x, w_TK, ws, dy)
    with reuse_weights(operands_to_reuse(2, False)) as scope:
        passes = [_pass(idx, x, w_TK, ws, dy) for _ in range(3)]  # one more than announced: evaluation, say
    assert (scope.misses, scope.hits) == (8, 4)
    assert all(torch.equal(y, fresh[0]) and torch.equal(dx, fresh[1]) for y, dx in passes)


@pytest.mark.parametrize("Fh", [96, 1024, 1100])  # 1100: wider than one tile, quantized after the SwiGLU kernel
def test_swiglu_fp8_variants_equal_swiglu_then_quantize_rows(Fh):
    gen = torch.Generator().manual_seed(7)
    N, R = 40, 33
    gu = (torch.randn(N, 2 * Fh, generator=gen) * torch.logspace(-3, 1, N)[:, None]).bfloat16()
    g, u = gu[:, :Fh], gu[:, Fh:]  # the halves of the gate-up GEMM's output, as the layer passes them
    dh = (torch.randn(N, Fh, generator=gen) * torch.logspace(2, -2, N)[:, None]).bfloat16()
    num_rows = torch.tensor(R, dtype=torch.int32)
    assert swiglu.fuses_fp8(Fh) == (Fh <= 1024)

    hq, hs = swiglu.swiglu_fwd_fp8(g, u, num_rows)
    hq_want, hs_want = fp8.quantize_rows(swiglu.swiglu_fwd(g, u, num_rows), num_rows)
    assert torch.equal(_bits(hq[:R]), _bits(hq_want[:R])) and torch.equal(hs[:R], hs_want[:R])

    row_pair = torch.randperm(N, generator=gen).int()  # rows serve pairs of 10 tokens x top-4 in shuffled order
    routing = (torch.rand(10, 4, generator=gen), row_pair)
    for kw in ({}, {"routing": routing}):
        *grads, q, s = swiglu.swiglu_bwd_fp8(g, u, dh, num_rows, **kw)
        want = swiglu.swiglu_bwd(g, u, dh, num_rows, **kw)
        assert len(grads) == len(want)
        for got, w in zip(grads[:3], want[:3]):
            assert torch.equal(got[:R], w[:R])
        if kw:
            assert torch.equal(grads[3], want[3]) and bool((grads[3].view(-1)[row_pair[R:].long()] == 0).all())
        q_want, s_want = fp8.quantize_rows(grads[0], num_rows, tail=grads[1])
        assert q.shape == (N, 2 * Fh) and torch.equal(_bits(q[:R]), _bits(q_want[:R]))
        assert torch.equal(s[:R], s_want[:R])
