"""Model and MoE layer: shapes, causality, EP slicing, dense <-> 1-expert MoE equivalence, router losses."""

from dataclasses import replace

import pytest
import torch

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.errors import DataError
from moe_launch.trainer.model import build_model
from moe_launch.trainer.model.upcycle import upcycle_dense_state
from moe_launch.trainer.moe.layer import MoELayer
from moe_launch.trainer.moe.losses import expert_counts, load_balancing_loss, router_z_loss

torch.set_num_threads(1)

SMALL_MOE = ModelConfig(name="t", kind="moe", vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24))
SMALL_DENSE = replace(SMALL_MOE, kind="dense", ffn_hidden=24)


def _tokens(B=2, S=12, V=97, seed=0):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [SMALL_MOE, SMALL_DENSE], ids=["moe", "dense"])
def test_forward_shape_and_causality(cfg):
    torch.manual_seed(0)
    model = build_model(cfg)
    x = _tokens()
    logits = model(x)
    assert logits.shape == (2, 12, cfg.vocab_size)
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 1) % cfg.vocab_size
    # MoE routing is per token, so the prefix cannot see the changed suffix either
    torch.testing.assert_close(model(x2)[:, :8], logits[:, :8], rtol=0, atol=0)
    assert not torch.equal(model(x2)[:, 8:], logits[:, 8:])


def test_build_is_seeded_and_expert_parallel_slices_match():
    torch.manual_seed(7)
    full = build_model(SMALL_MOE)
    for ep_size in (2, 4):
        for ep_rank in range(ep_size):
            torch.manual_seed(7)
            part = build_model(SMALL_MOE, ep_rank=ep_rank, ep_size=ep_size)
            lo, n = ep_rank * 4 // ep_size, 4 // ep_size
            for (name, p_full), (_, p_part) in zip(full.named_parameters(), part.named_parameters()):
                if getattr(p_full, "_moe_expert", False):
                    assert getattr(p_part, "_moe_expert", False)
                    assert torch.equal(p_part, p_full[lo : lo + n]), name
                else:
                    assert torch.equal(p_part, p_full), name
            assert part.blocks[0].ffn.e_start == lo and part.blocks[0].ffn.num_experts == 4
    torch.manual_seed(8)
    other = build_model(SMALL_MOE)
    assert not torch.equal(other.embed.weight, full.embed.weight)


def test_expert_params_marked_and_named():
    model = build_model(SMALL_MOE)
    layer = model.blocks[0].ffn
    assert isinstance(layer, MoELayer)
    assert layer.w_gate_EFD.shape == (4, 24, 32) and layer.w_up_EFD.shape == (4, 24, 32)
    assert layer.w_down_EDF.shape == (4, 32, 24)
    marked = {n for n, p in model.named_parameters() if getattr(p, "_moe_expert", False)}
    assert marked == {f"blocks.{i}.ffn.{w}" for i in range(2) for w in ("w_gate_EFD", "w_up_EFD", "w_down_EDF")}


def test_one_expert_top1_moe_from_dense_matches_dense_loss():
    torch.manual_seed(1)
    dense = build_model(SMALL_DENSE)
    cfg = replace(SMALL_MOE, moe=MoEConfig(num_experts=1, top_k=1, expert_hidden=24))
    moe = build_model(cfg)
    missing, unexpected = moe.load_state_dict(upcycle_dense_state(dense.state_dict(), 1), strict=False)
    assert not unexpected and set(missing) == {"blocks.0.ffn.router.weight", "blocks.1.ffn.router.weight"}
    x = _tokens(S=13)
    loss_d, parts_d = dense.compute_loss(x[:, :-1], x[:, 1:])
    loss_m, parts_m = moe.compute_loss(x[:, :-1], x[:, 1:])
    torch.testing.assert_close(parts_m.lm_loss, parts_d.lm_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(moe(x), dense(x), rtol=1e-5, atol=1e-5)
    # one expert always gets every token: the Switch loss is exactly 1 per layer
    assert all(float(a) == pytest.approx(1.0) for a in parts_m.aux_per_layer)
    assert float(parts_d.aux_loss) == 0.0 and float(parts_d.z_loss) == 0.0


def test_loss_parts_add_up_and_gradients_reach_router():
    torch.manual_seed(2)
    model = build_model(SMALL_MOE)
    x = _tokens()
    loss, parts = model.compute_loss(x[:, :-1], x[:, 1:])
    aux = SMALL_MOE.moe.aux_loss_coef * sum(parts.aux_per_layer)
    z = SMALL_MOE.moe.z_loss_coef * sum(parts.z_per_layer)
    torch.testing.assert_close(loss.detach(), parts.lm_loss + aux + z)
    loss.backward()
    for block in model.blocks:
        assert block.ffn.router.weight.grad.abs().sum() > 0
        assert block.ffn.w_down_EDF.grad.abs().sum() > 0
    assert [int(c.sum()) for c in parts.counts_per_layer] == [2 * 11 * 2] * 2


def test_sequence_longer_than_max_is_a_clear_error():
    model = build_model(SMALL_MOE)
    with pytest.raises(DataError, match="max_seq_len"):
        model(_tokens(S=17))


def test_uniform_routing_balances_and_topk_renorm():
    torch.manual_seed(3)
    layer = MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8, uniform_routing=True, norm_topk_prob=True))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    r = layer.router(torch.randn(12, 16))
    assert expert_counts(r.idx_TK, 4).tolist() == [6, 6, 6, 6]
    assert all(len(set(row)) == 2 for row in r.idx_TK.tolist())
    torch.testing.assert_close(r.w_TK.sum(-1), torch.ones(12))
    y, stats = layer(torch.randn(3, 4, 16))
    assert y.shape == (3, 4, 16) and stats.counts_E.tolist() == [6, 6, 6, 6]


def test_router_loss_values():
    probs_TE = torch.full((8, 4), 0.25)
    assert float(load_balancing_loss(probs_TE, torch.tensor([4, 4, 4, 4]))) == pytest.approx(1.0)
    collapsed = torch.tensor([[1.0, 0, 0, 0]] * 8)
    assert float(load_balancing_loss(collapsed, torch.tensor([8, 0, 0, 0]))) == pytest.approx(4.0)
    logits_TE = torch.zeros(5, 4)
    assert float(router_z_loss(logits_TE)) == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)


def test_topk_weights_without_renorm_are_router_probs():
    torch.manual_seed(4)
    layer = MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8))
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    x = torch.randn(10, 16)
    r = layer.router(x)
    torch.testing.assert_close(r.w_TK, r.probs_TE.gather(1, r.idx_TK))
    assert r.logits_TE.dtype == torch.float32 and (r.w_TK.sum(-1) < 1).all()


def test_bf16_autocast_forward_backward_on_cpu():
    """The residual stream stays fp32 under autocast while the experts compute in bf16 (GPU training's setting)."""
    torch.manual_seed(5)
    model = build_model(SMALL_MOE)
    x = _tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, parts = model.compute_loss(x[:, :-1], x[:, 1:])
    loss.backward()
    ref, _ = model.compute_loss(x[:, :-1], x[:, 1:])
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(float(loss.detach()) - float(ref.detach())) < 0.05
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
