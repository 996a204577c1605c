"""Chunked head + cross-entropy (trainer/model/loss.py) equals F.cross_entropy on full fp32 logits: loss and the
gradients of hidden states and head weight, over chunk sizes with ragged tails, ignored targets and a scaled loss;
and Transformer.compute_loss with it equals the unfused formula for every parameter's gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.trainer.model import build_model
from moe_launch.trainer.model.loss import IGNORE_INDEX, chunk_tokens, chunked_cross_entropy, logit_bytes

torch.set_num_threads(1)

T, D, V = 37, 16, 53  # odd sizes: every chunk size below leaves a ragged tail


def _inputs(seed: int = 0, ignore: bool = False):
    g = torch.Generator().manual_seed(seed)
    h_TD = torch.randn(T, D, generator=g, dtype=torch.float64).float().requires_grad_()
    w_VD = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    y_T = torch.randint(0, V, (T,), generator=g)
    if ignore:
        y_T[::5] = IGNORE_INDEX
    return h_TD, w_VD, y_T


def _reference(h_TD, w_VD, y_T, scale):
    h, w = h_TD.detach().clone().requires_grad_(), w_VD.detach().clone().requires_grad_()
    loss = F.cross_entropy((h @ w.t()).float(), y_T, ignore_index=IGNORE_INDEX)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 8, 36, 37, 1000])
@pytest.mark.parametrize("ignore", [False, True])
def test_chunked_equals_full_logits(chunk, ignore):
    h_TD, w_VD, y_T = _inputs(ignore=ignore)
    scale = 0.25  # the loss / accum_steps the trainer backpropagates
    ref_loss, ref_dh, ref_dw = _reference(h_TD, w_VD, y_T, scale)
    loss = chunked_cross_entropy(h_TD, w_VD, y_T, chunk=chunk)
    (loss * scale).backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h_TD.grad, ref_dh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w_VD.grad, ref_dw, rtol=1e-5, atol=1e-7)


def test_without_grad_gives_the_loss_only():
    h_TD, w_VD, y_T = _inputs(seed=1)
    ref_loss, _, _ = _reference(h_TD, w_VD, y_T, 1.0)
    with torch.no_grad():
        loss = chunked_cross_entropy(h_TD, w_VD, y_T, chunk=10)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)


def test_bf16_autocast_matches_the_autocast_reference():
    h_TD, w_VD, y_T = _inputs(seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((h_TD @ w_VD.t()).float(), y_T)  # what compute_loss did before: bf16 logits
        loss = chunked_cross_entropy(h_TD, w_VD, y_T, chunk=8)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
    loss.backward()
    assert h_TD.grad.dtype == w_VD.grad.dtype == torch.float32


def test_chunk_size_default_bounds_logits():
    torch_bf16, fused_bf16 = logit_bytes(torch.bfloat16, False), logit_bytes(torch.bfloat16, True)
    assert (torch_bf16, fused_bf16, logit_bytes(torch.float32, False)) == (8, 2, 12)
    # torch's passes: bf16 logits + fp32 softmax + bf16 gradient = 8 B per logit, 2560 x 50304 x 8 = 983 MiB
    assert chunk_tokens(50304, torch_bf16) == 2560
    # the fused kernel keeps one bf16 buffer: four times the tokens in the same bytes
    assert chunk_tokens(50304, fused_bf16) == 10624
    assert chunk_tokens(10**9, fused_bf16) == 128


def test_compute_loss_equals_the_unfused_formula():
    cfg = ModelConfig(name="t", kind="moe", vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, aux_loss_coef=0.01, z_loss_coef=0.001))
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    loss, parts = model.compute_loss(x[:, :-1], x[:, 1:])
    loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits, stats = model.forward_with_stats(x[:, :-1])
    lm = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    aux = sum(s.aux_loss for s in stats) * cfg.moe.aux_loss_coef
    z = sum(s.z_loss for s in stats) * cfg.moe.z_loss_coef
    (lm + aux + z).backward()
    torch.testing.assert_close(parts.lm_loss, lm.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss.detach(), (lm + aux + z).detach(), rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("fusion", [True, False])
def test_cross_entropy_fusion_reaches_the_head(monkeypatch, fusion):
    """model.cross_entropy_fusion is what the model's and the pipeline stage's head are called with."""
    from moe_launch.trainer.model import transformer
    from moe_launch.trainer.pipeline import stage as stage_mod

    seen = []

    def spy(*args, fused, **kwargs):
        seen.append(fused)
        return chunked_cross_entropy(*args, fused=fused, **kwargs)

    monkeypatch.setattr(transformer, "chunked_cross_entropy", spy)
    monkeypatch.setattr(stage_mod, "chunked_cross_entropy", spy)
    cfg = ModelConfig(name="t", kind="dense", vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                      ffn_hidden=48, cross_entropy_fusion=fusion)
    model = build_model(cfg)
    x = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    model.compute_loss(x[:, :-1], x[:, 1:])
    stage = stage_mod.build_stage_model(cfg, {0: range(0, 2)}, 1)  # one stage holding the whole model
    stage.forward_chunk(0, x[:, :-1], x[:, 1:])
    assert seen == [fusion, fusion]
