"""train.recompute: identical losses, gradients and updates with and without recomputation, less activation memory
(measured with a live-storage probe on CPU), unchanged parameter names."""

from __future__ import annotations

import pytest
import torch
from mem_probe import peak_live_bytes, saved_bytes

from moe_launch.conf.schema import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_launch.errors import ConfigError
from moe_launch.trainer.model import build_model
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import build_optimizer
from moe_launch.trainer.recompute import apply_recompute, recompute_targets

torch.set_num_threads(1)
TRAIN = TrainConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.5)


def _cfg(kind: str = "moe") -> ModelConfig:
    return ModelConfig(kind=kind, vocab_size=64, d_model=32, n_layers=3, n_heads=4, max_seq_len=32, ffn_hidden=64,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.5, z_loss_coef=0.1))


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(step))


def _train(kind: str, recompute: list[str], steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = build_model(_cfg(kind))
    changed = apply_recompute(model, recompute)
    opt = build_optimizer(model, TRAIN, ParallelConfig(), build_groups(ParallelConfig()))
    losses, grads = [], []
    for step in range(steps):
        batch = _tokens(step)
        loss, parts = model.compute_loss(batch[:, :-1], batch[:, 1:])
        loss.backward()
        losses.append((loss.item(), parts.aux_loss.item(), parts.z_loss.item()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.reduce_grads()
        opt.clip_grad_norm_(TRAIN.grad_clip)
        opt.step(TRAIN.lr)
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "changed": changed,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _fwd_bwd(kind: str, recompute: list[str]):
    torch.manual_seed(0)
    model = build_model(_cfg(kind))
    apply_recompute(model, recompute)
    batch = _tokens(0)
    return lambda: model.compute_loss(batch[:, :-1], batch[:, 1:])[0].backward()


@pytest.mark.parametrize("kind,recompute", [
    ("moe", ["norm"]), ("moe", ["attention"]), ("moe", ["moe"]), ("moe", ["norm", "attention", "moe"]),
    ("moe", ["full"]), ("dense", ["mlp", "attention"])])
def test_recompute_changes_nothing_but_memory(kind, recompute):
    base, rec = _train(kind, []), _train(kind, recompute)
    assert rec["changed"] and not base["changed"]
    assert rec["losses"] == base["losses"]  # bitwise: the same operators run on the same inputs
    for g_rec, g_base in zip(rec["grads"], base["grads"]):
        assert g_rec.keys() == g_base.keys()
        for name in g_base:
            assert torch.equal(g_rec[name], g_base[name]), name
    assert rec["params"].keys() == base["params"].keys()  # names unchanged: checkpoints stay compatible
    for name in base["params"]:
        assert torch.equal(rec["params"][name], base["params"][name]), name


def test_recompute_lowers_peak_activation_memory():
    peak = {tuple(k): peak_live_bytes(_fwd_bwd("moe", k)) for k in
            ([], ["norm"], ["attention"], ["moe"], ["norm", "attention", "moe"], ["full"])}
    saved = {tuple(k): saved_bytes(_fwd_bwd("moe", k)) for k in ([], ["norm", "attention", "moe"], ["full"])}
    print("peak live bytes (forward + backward):", peak)
    print("bytes saved for backward outside recomputed regions:", saved)
    none = peak[()]
    for kinds in (("attention",), ("moe",), ("norm", "attention", "moe"), ("full",)):
        assert peak[kinds] < none, kinds
    assert peak[("norm", "attention", "moe")] < min(peak[("attention",)], peak[("moe",)])
    assert saved[("full",)] < saved[("norm", "attention", "moe")] < saved[()]


def test_targets_per_kind_and_bad_kind():
    model = build_model(_cfg("moe"))
    names = lambda kinds: [n for n, _ in recompute_targets(model, kinds)]  # noqa: E731
    assert names(["norm"]) == [f"blocks.{i}.{m}" for i in range(3) for m in ("attn_norm", "ffn_norm")] + ["norm"]
    assert names(["moe"]) == [f"blocks.{i}.ffn" for i in range(3)]
    assert names(["mlp"]) == []  # no dense feed-forward in an MoE model
    assert names(["full", "norm"]) == [f"blocks.{i}" for i in range(3)] + ["norm"]
    assert len(apply_recompute(model, ["attention"])) == 3 and apply_recompute(model, ["attention"]) == []
    with pytest.raises(ConfigError, match=r"train.recompute\[1\]"):
        apply_recompute(model, ["norm", "ffn"])
