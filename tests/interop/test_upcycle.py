"""Dense -> MoE upcycling reproduces the dense model's loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.errors import ConfigError
from moe_launch.trainer.interop.gather import write_model_checkpoint
from moe_launch.trainer.interop.upcycle import upcycle_checkpoint, upcycle_state
from moe_launch.trainer.model import build_model

DENSE = ModelConfig(kind="dense", vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=32)


def _moe(E: int, K: int, norm: bool) -> ModelConfig:
    return dataclasses.replace(DENSE, kind="moe", moe=MoEConfig(num_experts=E, top_k=K, expert_hidden=48,
                                                                 norm_topk_prob=norm))


def _batch():
    g = torch.Generator().manual_seed(9)
    seq = torch.randint(0, 64, (3, 21), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _dense_loss() -> tuple[dict, float]:
    torch.manual_seed(11)
    dense = build_model(DENSE)
    with torch.no_grad():
        _, parts = dense.compute_loss(*_batch())
    return dense.state_dict(), float(parts.lm_loss)


@pytest.mark.parametrize("E,K,norm", [(1, 1, False), (4, 2, False), (4, 2, True), (8, 1, False)])
def test_upcycled_model_reproduces_dense_loss(E, K, norm):
    torch.set_num_threads(1)
    dense_sd, dense_loss = _dense_loss()
    moe = build_model(_moe(E, K, norm))
    moe.load_state_dict(upcycle_state(dense_sd, _moe(E, K, norm)), strict=True)
    with torch.no_grad():
        _, parts = moe.compute_loss(*_batch())
    assert float(parts.lm_loss) == pytest.approx(dense_loss, rel=1e-6, abs=0)
    assert torch.count_nonzero(moe.blocks[0].ffn.router.weight) == 0


def test_without_preservation_the_output_changes():
    """The E/K scaling is what makes the 4-expert top-2 model exact (a test that the check above can fail)."""
    torch.set_num_threads(1)
    dense_sd, dense_loss = _dense_loss()
    cfg = _moe(4, 2, False)
    moe = build_model(cfg)
    moe.load_state_dict(upcycle_state(dense_sd, cfg, preserve_output=False), strict=True)
    with torch.no_grad():
        _, parts = moe.compute_loss(*_batch())
    assert abs(float(parts.lm_loss) - dense_loss) > 1e-4


def test_ep_shards_and_small_router():
    dense_sd, _ = _dense_loss()
    cfg = _moe(4, 2, False)
    full = upcycle_state(dense_sd, cfg, router_std=0.01, seed=5)
    for r in range(2):
        part = upcycle_state(dense_sd, cfg, ep_rank=r, ep_size=2, router_std=0.01, seed=5)
        assert part["blocks.1.ffn.w_up_EFD"].shape[0] == 2
        assert torch.equal(part["blocks.1.ffn.router.weight"], full["blocks.1.ffn.router.weight"])
    assert 0 < float(full["blocks.0.ffn.router.weight"].std()) < 0.02
    assert torch.equal(full["blocks.0.ffn.w_gate_EFD"][3], dense_sd["blocks.0.ffn.gate_proj.weight"])


def test_upcycle_checkpoint_for_ep2(tmp_path):
    torch.set_num_threads(1)
    dense_sd, dense_loss = _dense_loss()
    write_model_checkpoint(dense_sd, DENSE, tmp_path / "dense")
    cfg = _moe(4, 2, True)
    out = upcycle_checkpoint(tmp_path / "dense", cfg, tmp_path / "moe", ep_size=2)
    from moe_launch.trainer.interop.gather import full_state_from_checkpoint

    state, saved = full_state_from_checkpoint(out)
    assert saved == cfg
    moe = build_model(cfg)
    moe.load_state_dict(state, strict=True)
    with torch.no_grad():
        _, parts = moe.compute_loss(*_batch())
    assert float(parts.lm_loss) == pytest.approx(dense_loss, rel=1e-6, abs=0)
    with pytest.raises(ConfigError, match="model.moe.expert_hidden"):
        upcycle_checkpoint(tmp_path / "dense", dataclasses.replace(cfg, moe=MoEConfig(num_experts=4, top_k=2,
                                                                   expert_hidden=8)), tmp_path / "bad")
