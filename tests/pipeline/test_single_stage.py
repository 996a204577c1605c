"""One process (pp=1, chunks handed over locally): every schedule's step gives exactly the loss, loss parts and
gradients of Transformer.compute_loss accumulated over the same micro-batches, dense and MoE."""

from __future__ import annotations

import pytest
import torch

from moe_launch.conf.schema import ModelConfig, MoEConfig, ParallelConfig
from moe_launch.trainer.model import build_model
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.pipeline import build_pipeline, pipeline_step

torch.set_num_threads(1)


def _cfg(kind: str) -> ModelConfig:
    return ModelConfig(kind=kind, vocab_size=64, d_model=16, n_layers=4, n_heads=2, max_seq_len=16, ffn_hidden=32,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=8, aux_loss_coef=0.5, z_loss_coef=0.1))


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
def test_single_stage_equals_compute_loss(kind, schedule, virtual):
    cfg = _cfg(kind)
    mbs = [torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    torch.manual_seed(3)
    ref = build_model(cfg)
    ref_parts = []
    for mb in mbs:
        loss, parts = ref.compute_loss(mb[:, :-1], mb[:, 1:])
        (loss / 4).backward()
        ref_parts.append((loss.item(), parts))
    torch.manual_seed(3)
    pcfg = ParallelConfig(pp_schedule=schedule, pp_virtual_stages=virtual, microbatches=4)
    pipe = build_pipeline(cfg, pcfg, build_groups(ParallelConfig()))
    loss, parts = pipeline_step(pipe, mbs, reduce=False)
    assert [len(r) for r in pipe.chunk_ranges] == [4 // virtual] * virtual
    assert loss.item() == pytest.approx(sum(p[0] for p in ref_parts) / 4, rel=1e-6)
    assert parts.lm_loss.item() == pytest.approx(sum(p[1].lm_loss.item() for p in ref_parts) / 4, rel=1e-6)
    n_moe = 4 if kind == "moe" else 0
    assert len(parts.aux_per_layer) == len(parts.counts_per_layer) == n_moe
    for i in range(n_moe):
        assert parts.aux_per_layer[i].item() == pytest.approx(
            sum(p[1].aux_per_layer[i].item() for p in ref_parts) / 4, rel=1e-6)
        assert torch.equal(parts.counts_per_layer[i], sum(p[1].counts_per_layer[i] for p in ref_parts))
    grads = dict(ref.named_parameters())
    for name, p in pipe.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-6, atol=1e-7, msg=name)
