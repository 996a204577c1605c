"""ShardedAdamW's flat gradient buffers and fused update: every p.grad is a view into its bucket's buffer and autograd
accumulates into it across backward passes; zero_grad keeps the views; assigned gradients are adopted; the fused
(torch._fused_adamw_) update equals torch.optim.AdamW(fused=True) and the reference update; chunking the update and
the norm changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moe_launch.conf.schema import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_launch.trainer.model import build_model
from moe_launch.trainer.parallel import optimizer as optimizer_mod
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import ShardedAdamW, build_optimizer

torch.set_num_threads(1)

TRAIN = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
CFG = ModelConfig(name="t", kind="moe", vocab_size=61, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=8))


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(seed))


def _inside(t: torch.Tensor, buf: torch.Tensor) -> bool:
    lo = buf.data_ptr()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + buf.numel() * buf.element_size()


def test_autograd_accumulates_into_the_bucket_views():
    torch.manual_seed(0)
    model = build_model(CFG)
    plain = copy.deepcopy(model)  # no optimizer: torch's own .grad handling
    opt = build_optimizer(model, TRAIN, ParallelConfig(), build_groups(ParallelConfig()))
    for seed in (1, 2):  # two backward passes: the second must add into the same memory
        for m in (model, plain):
            b = _batch(seed)
            m.compute_loss(b[:, :-1], b[:, 1:])[0].backward()
    named_plain = dict(plain.named_parameters())
    for bucket in opt.buckets:
        for p, name in zip(bucket.params, bucket.param_names):
            assert _inside(p.grad, bucket.grad_buffer), name
            assert torch.equal(p.grad, named_plain[name].grad), name
    # the flat gradient is the buffer itself: no copy
    for bucket in opt.buckets:
        assert bucket.flat_grads().data_ptr() == bucket.grad_buffer.data_ptr()
    ptrs = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
    opt.reduce_grads()
    opt.clip_grad_norm_(1.0)
    opt.step(1e-3)
    opt.zero_grad()
    for n, p in model.named_parameters():
        assert p.grad.data_ptr() == ptrs[n] and not p.grad.any(), n


def test_assigned_and_missing_gradients_are_adopted():
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = build_optimizer(model, TRAIN, ParallelConfig(), build_groups(ParallelConfig()))
    params = dict(model.named_parameters())
    params["lm_head.weight"].grad = torch.full_like(params["lm_head.weight"], 2.0)  # replaces the view
    params["embed.weight"].grad = None
    opt.reduce_grads()
    bucket = next(b for b in opt.buckets if "lm_head.weight" in b.param_names)
    i = bucket.param_names.index("lm_head.weight")
    off, n = bucket.offsets[i], params["lm_head.weight"].numel()
    assert torch.equal(bucket.grad[off : off + n], torch.full((n,), 2.0))
    assert params["lm_head.weight"].grad.data_ptr() == bucket.grad_buffer[off:].data_ptr()
    assert params["embed.weight"].grad is not None and not params["embed.weight"].grad.any()


class Toy(nn.Module):
    """A decayed matrix, an undecayed vector and an expert tensor; odd sizes."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(7, 5, generator=g))
        self.b = nn.Parameter(torch.randn(5, generator=g))
        self.e = nn.Parameter(torch.randn(3, 4, 5, generator=g))
        self.e._moe_expert = True


def _grads(step: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {"w": torch.randn(7, 5, generator=g).to(dtype), "b": torch.randn(5, generator=g).to(dtype),
            "e": torch.randn(3, 4, 5, generator=g).to(dtype)}


def _run_ours(fused: bool, dtype=torch.float32, clip: float = 0.0, steps: int = 4):
    model = Toy().to(dtype)
    opt = ShardedAdamW(list(model.named_parameters()), build_groups(ParallelConfig()), "none",
                       betas=(TRAIN.beta1, TRAIN.beta2), eps=TRAIN.eps, weight_decay=TRAIN.weight_decay, fused=fused)
    norms = []
    for step in range(steps):
        for n, p in model.named_parameters():
            p.grad.copy_(_grads(step, dtype)[n])  # into the view, as autograd would
        opt.reduce_grads()
        norms.append(opt.clip_grad_norm_(clip))
        opt.step(TRAIN.lr * (step + 1) / steps)
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, {b.name: b.master.clone() for b in
                                                                           opt.buckets}, norms


def test_fused_update_equals_torch_fused_adamw():
    ours, _, _ = _run_ours(fused=True)
    model = Toy()
    opt = torch.optim.AdamW([{"params": [model.w, model.e]}, {"params": [model.b], "weight_decay": 0.0}],
                            lr=TRAIN.lr, betas=(TRAIN.beta1, TRAIN.beta2), eps=TRAIN.eps,
                            weight_decay=TRAIN.weight_decay, fused=True)
    for step in range(4):
        for n, p in model.named_parameters():
            p.grad = _grads(step)[n]
        for group in opt.param_groups:
            group["lr"] = TRAIN.lr * (step + 1) / 4
        opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.detach(), rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_reference_update_with_clipping(dtype):
    ref_params, ref_master, ref_norms = _run_ours(fused=False, dtype=dtype, clip=0.5)
    params, master, norms = _run_ours(fused=True, dtype=dtype, clip=0.5)
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    for name in ref_master:
        torch.testing.assert_close(master[name], ref_master[name], rtol=1e-6, atol=1e-7, msg=name)
    for n in ref_params:  # bf16 params: the rounding of nearly equal masters may differ by one bf16 ulp
        torch.testing.assert_close(params[n].float(), ref_params[n].float(), rtol=1e-2 if dtype != torch.float32
                                   else 1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunking_changes_nothing(monkeypatch, fused, dtype):
    # no clipping: the norm is summed per chunk, so its rounding (and a clip coefficient) may move by an ulp
    whole = _run_ours(fused=fused, dtype=dtype, clip=0.0)
    monkeypatch.setattr(optimizer_mod, "CHUNK", 6)  # every bucket cut into several chunks, with ragged tails
    chunked = _run_ours(fused=fused, dtype=dtype, clip=0.0)
    for n in whole[0]:
        assert torch.equal(whole[0][n], chunked[0][n]), n  # element-wise update: bitwise
    assert chunked[2] == pytest.approx(whole[2], rel=1e-6)


def test_local_grad_norm_is_the_norm_and_flags_non_finite():
    model = Toy()
    opt = ShardedAdamW(list(model.named_parameters()), build_groups(ParallelConfig()), "none",
                       betas=(TRAIN.beta1, TRAIN.beta2), eps=TRAIN.eps, weight_decay=TRAIN.weight_decay)
    grads = _grads(0)
    for n, p in model.named_parameters():
        p.grad.copy_(grads[n])
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()])).item()
    local = opt.local_grad_norm()
    assert local.device.type == "cpu" and local.item() == pytest.approx(want, rel=1e-6)
    opt.reduce_grads()
    assert opt.grad_norm() == pytest.approx(want, rel=1e-6)  # one data rank: the cached local norm is reused
    opt.zero_grad()
    model.w.grad[1, 2] = float("inf")
    assert not torch.isfinite(opt.local_grad_norm())
