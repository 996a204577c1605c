"""Loading an fp32 master into bf16 parameters + int16 remainders (Bucket.set_master) piece by piece, where the
parameters live, gives the same bits as one split: what a restore from a host-side checkpoint does."""

from __future__ import annotations

import torch

from moe_launch.conf.schema import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_launch.trainer.model import build_model
from moe_launch.trainer.parallel import buckets as buckets_mod
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import build_optimizer

CFG = ModelConfig(name="t", kind="moe", vocab_size=61, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=8))


def _bf16_optimizer():
    torch.manual_seed(0)
    model = build_model(CFG, 0, 1, torch.device("cpu"))
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return build_optimizer(model, TrainConfig(), ParallelConfig(), build_groups(ParallelConfig()))


def test_master_loaded_in_pieces_is_bitwise_the_one_split(monkeypatch):
    masters = {}
    for b in _bf16_optimizer().buckets:
        masters[b.name] = torch.randn(b.shard_len, generator=torch.Generator().manual_seed(len(masters)))
    whole, pieces = _bf16_optimizer(), _bf16_optimizer()
    for b in whole.buckets:
        b.master = masters[b.name]
    monkeypatch.setattr(buckets_mod, "_SPLIT_PIECE", 7)  # many pieces with a ragged tail
    for b in pieces.buckets:
        b.master = masters[b.name]
    for a, b in zip(whole.buckets, pieces.buckets):
        assert torch.equal(a.param_shard.view(torch.int16), b.param_shard.view(torch.int16)), a.name
        assert torch.equal(a.remainder, b.remainder) and torch.equal(b.master, masters[b.name]), a.name
