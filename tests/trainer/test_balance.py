"""Routing balance (model.moe.balance): aux_free_bias and sinkhorn balance a skewed router; the combine weights and
the router's gradients are the plain softmax probabilities at the chosen experts; only aux_loss adds the aux loss;
the bias is trained by the trainer, kept fp32, saved in checkpoints and restored."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_harness import tiny_cfg, write_run

from moe_launch.conf.schema import MoEConfig
from moe_launch.errors import ConfigError
from moe_launch.rundir import EXIT_OK
from moe_launch.trainer.checkpoint.store import load_file
from moe_launch.trainer.moe.balance import BiasBalancer, bias_step_E
from moe_launch.trainer.moe.losses import expert_counts, load_imbalance
from moe_launch.trainer.moe.router import Router, sinkhorn_log_scores
from moe_launch.trainer.parallel.comm import self_axis

torch.set_num_threads(1)
E, K, D, T = 8, 2, 16, 512


def _skewed_router(balance: str, gen: torch.Generator, rate: float = 1e-3) -> tuple[Router, torch.Tensor]:
    """A router whose plain top-k sends most tokens to experts 0 and 1 (a shared input direction they favour)."""
    router = Router(D, MoEConfig(num_experts=E, top_k=K, balance=balance, bias_update_rate=rate))
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, D, generator=gen) * 0.3)
        router.weight[:2, 0] += 3.0
    x_TD = torch.randn(T, D, generator=gen)
    x_TD[:, 0] = 1.0 + 0.1 * x_TD[:, 0].abs()
    return router, x_TD


def _imbalance(router: Router, x_TD: torch.Tensor) -> float:
    return float(load_imbalance(expert_counts(router(x_TD).idx_TK, E)))


def test_aux_free_bias_balances_a_skewed_router_by_load_updates_alone():
    gen = torch.Generator().manual_seed(0)
    router, x_TD = _skewed_router("aux_free_bias", gen, rate=2e-3)
    before = _imbalance(router, x_TD)
    balancer = BiasBalancer.of(router, 2e-3, self_axis(0))
    weight = router.weight.detach().clone()
    for _ in range(400):
        balancer.update([expert_counts(router(x_TD).idx_TK, E)])
    after = _imbalance(router, x_TD)
    assert before > 3.0 and after < 1.25, (before, after)
    assert torch.equal(router.weight, weight)  # only the bias moved
    assert router.expert_bias_E[:2].max() < 0 < router.expert_bias_E[2:].min()  # hot experts pushed down


def test_bias_step_is_signed_towards_the_mean_and_zero_when_balanced():
    assert torch.equal(bias_step_E(torch.tensor([5, 1, 3, 3]), 0.5), torch.tensor([-0.5, 0.5, 0.0, 0.0]).double())
    assert bias_step_E(torch.full((8,), 7), 1e-3).abs().sum() == 0


@pytest.mark.parametrize("balance", ["aux_free_bias", "sinkhorn"])
def test_selection_changes_but_weights_and_gradients_are_the_softmax_at_the_chosen_experts(balance):
    gen = torch.Generator().manual_seed(1)
    router, x_TD = _skewed_router(balance, gen)
    if balance == "aux_free_bias":
        with torch.no_grad():
            router.expert_bias_E.copy_(torch.linspace(-0.3, 0.3, E))
    x_TD.requires_grad_()
    r = router(x_TD)
    plain_idx_TK = r.probs_TE.topk(K, dim=-1).indices
    assert not torch.equal(r.idx_TK, plain_idx_TK)  # the balancer did change the selection
    c_TK = torch.randn(T, K, generator=gen)
    got = torch.autograd.grad((r.w_TK * c_TK).sum(), (router.weight, x_TD))
    # the same selection, the combine weights computed by hand from an unbalanced softmax
    probs_TE = (x_TD @ router.weight.t()).softmax(-1)
    want = torch.autograd.grad((probs_TE.gather(1, r.idx_TK) * c_TK).sum(), (router.weight, x_TD))
    assert torch.equal(r.w_TK, probs_TE.gather(1, r.idx_TK).detach())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    if balance == "aux_free_bias":
        assert router.expert_bias_E.grad is None and not router.expert_bias_E.requires_grad


def test_sinkhorn_balances_a_skewed_router_without_any_state():
    gen = torch.Generator().manual_seed(2)
    plain, x_TD = _skewed_router("aux_loss", gen)
    sink = Router(D, MoEConfig(num_experts=E, top_k=K, balance="sinkhorn"))
    sink.load_state_dict(plain.state_dict())
    before, after = _imbalance(plain, x_TD), _imbalance(sink, x_TD)
    assert before > 3.0 and after < 1.5, (before, after)
    log_TE = sinkhorn_log_scores(torch.randn(64, E, generator=gen) * 5)
    torch.testing.assert_close(log_TE.exp().sum(1), torch.ones(64))  # rows are distributions
    torch.testing.assert_close(log_TE.exp().sum(0), torch.full((E,), 64 / E), rtol=0.05, atol=0)


def test_aux_loss_enters_the_training_loss_only_with_balance_aux_loss(data_cache):
    from moe_launch.trainer.model import build_model

    cfg = tiny_cfg(data_cache)
    tokens_BS = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(3))
    for balance in ("aux_loss", "aux_free_bias", "sinkhorn"):
        m = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, balance=balance))
        torch.manual_seed(0)
        model = build_model(m, 0, 1, torch.device("cpu"))
        loss, parts = model.compute_loss(tokens_BS[:, :-1], tokens_BS[:, 1:])
        assert float(torch.stack(parts.aux_per_layer).sum()) > 0  # still measured and reported
        extra = float(parts.aux_loss) if balance == "aux_loss" else 0.0
        assert float(parts.aux_loss) == pytest.approx(extra)
        assert float(loss.detach()) == pytest.approx(float(parts.lm_loss + parts.z_loss) + extra, rel=1e-6)


def test_config_rejects_unknown_balance_and_bad_rate():
    with pytest.raises(ConfigError) as err:
        MoEConfig(balance="switch")
    assert err.value.key == "model.moe.balance"
    with pytest.raises(ConfigError) as err:
        MoEConfig(balance="aux_free_bias", bias_update_rate=0.0)
    assert err.value.key == "model.moe.bias_update_rate"


def test_trainer_learns_the_bias_keeps_it_fp32_and_restores_it_from_checkpoints(tmp_path, data_cache):
    from moe_launch.trainer.loop import Trainer

    cfg = tiny_cfg(data_cache, steps=4, ckpt_interval=2, dtype="fp32")
    cfg.model.moe = dataclasses.replace(cfg.model.moe, balance="aux_free_bias")
    rd = write_run(tmp_path / "run", cfg)
    trainer = Trainer(cfg, rd)
    assert trainer.train() == EXIT_OK
    biases = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n.endswith("expert_bias_E")}
    assert len(biases) == 2 and all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in biases.values())
    assert all(not p.requires_grad for n, p in trainer.model.named_parameters() if n in biases)
    saved = load_file(rd.checkpoints / "ckpt-b", "model/dense.pt")  # step 4
    for n, b in biases.items():
        assert torch.equal(saved[n], b)
    resumed = Trainer(cfg, rd, attempt=1)  # resumes at step 4 from the newest slot
    for n, p in resumed.model.named_parameters():
        if n in biases:
            assert torch.equal(p, biases[n])


def test_a_fresh_model_starts_with_a_neutral_bias_and_routes_like_aux_loss(data_cache):
    """The initialiser draws every weight at random; the bias is state moved by load, and starts at zero."""
    from moe_launch.trainer.model import build_model

    cfg = tiny_cfg(data_cache)
    models = {}
    for balance in ("aux_loss", "aux_free_bias"):
        m = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, balance=balance))
        torch.manual_seed(0)
        models[balance] = build_model(m, 0, 1, torch.device("cpu"))
    biases = [p for n, p in models["aux_free_bias"].named_parameters() if n.endswith("expert_bias_E")]
    assert biases and all(bool((b == 0).all()) for b in biases)
    tokens_BS = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(4))
    counts = {k: [c.tolist() for c in m.compute_loss(tokens_BS[:, :-1], tokens_BS[:, 1:])[1].counts_per_layer]
              for k, m in models.items()}
    assert counts["aux_free_bias"] == counts["aux_loss"]


def test_hf_round_trip_of_an_aux_free_bias_model_keeps_a_neutral_bias(tmp_path, data_cache):
    """OLMoE's format has no selection bias: export drops it, import leaves the fresh (zero) one in place."""
    from moe_launch.trainer.interop.hf import export_hf, load_hf_into_model
    from moe_launch.trainer.model import build_model

    cfg = tiny_cfg(data_cache)
    m = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, balance="aux_free_bias"))
    torch.manual_seed(0)
    src = build_model(m, 0, 1, torch.device("cpu"))
    with torch.no_grad():
        src.blocks[0].ffn.router.expert_bias_E.fill_(0.5)
    export_hf({n: p.detach() for n, p in src.named_parameters()}, m, tmp_path / "hf")
    torch.manual_seed(1)
    dst = build_model(m, 0, 1, torch.device("cpu"))
    load_hf_into_model(dst, tmp_path / "hf")
    for (n, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(b, torch.zeros_like(b) if n.endswith("expert_bias_E") else a), n
