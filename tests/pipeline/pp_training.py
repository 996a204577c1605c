"""Five optimizer steps of the tiny MoE decoder, unpipelined on one process or pipelined under PP x DP x EP.

The global batch of a step is DATA x M micro-batches; data rank d takes micro-batches [d*M, (d+1)*M) and runs them
through its pipeline (loss scale 1/M, the optimizer divides by the data size). The single-process reference
accumulates all DATA x M micro-batches with loss / (DATA x M): the same gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_launch.conf.schema import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_launch.trainer.model import build_model
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import build_optimizer
from moe_launch.trainer.pipeline import build_pipeline, pipeline_step

SEED, SEQ, MBS, M, VOCAB = 11, 8, 2, 4, 64
TRAIN = TrainConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.5, global_batch_size=8, micro_batch_size=MBS, seq_len=SEQ)
# coefficients far above the usual 1e-2 / 1e-3 so that a dropped aux / z gradient moves the parameters visibly
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, aux_loss_coef=0.5, z_loss_coef=0.1)


def model_cfg(n_layers: int = 4, dispatcher: str = "allgather") -> ModelConfig:
    moe = MoEConfig(**{**MOE.__dict__, "dispatcher": dispatcher})
    return ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=n_layers, n_heads=2, max_seq_len=16, moe=moe)


def micro_batches(step: int, data_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return list(torch.randint(0, VOCAB, (data_size * M * MBS, SEQ + 1), generator=g).split(MBS))


def lr_at(step: int) -> float:
    return TRAIN.lr * (step + 1) / 3


def reference_run(steps: int, data_size: int) -> dict[str, Any]:
    """Unpipelined: Transformer.compute_loss over every micro-batch of the global batch."""
    torch.manual_seed(SEED)
    model = build_model(model_cfg())
    opt = build_optimizer(model, TRAIN, ParallelConfig(), build_groups(ParallelConfig()))
    out: dict[str, Any] = {"losses": [], "aux": [], "z": [], "aux_per_layer": [], "norms": []}
    for step in range(steps):
        mbs = micro_batches(step, data_size)
        per = []
        for mb in mbs:
            loss, parts = model.compute_loss(mb[:, :-1], mb[:, 1:])
            (loss / len(mbs)).backward()
            per.append((loss.item(), parts.aux_loss.item(), parts.z_loss.item(),
                        [a.item() for a in parts.aux_per_layer]))
        # per data rank means, as each pipeline reports them
        ranks = [per[d * M : (d + 1) * M] for d in range(data_size)]
        out["losses"].append([sum(p[0] for p in r) / M for r in ranks])
        out["aux"].append([sum(p[1] for p in r) / M for r in ranks])
        out["z"].append([sum(p[2] for p in r) / M for r in ranks])
        out["aux_per_layer"].append([[sum(p[3][i] for p in r) / M for i in range(len(r[0][3]))] for r in ranks])
        opt.reduce_grads()
        out["norms"].append(opt.clip_grad_norm_(TRAIN.grad_clip))
        opt.step(lr_at(step))
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def pipelined_run(steps: int, dp: int, ep: int, pp: int, schedule: str, virtual: int = 1, strategy: str = "none",
                  dispatcher: str = "allgather", recompute: tuple[str, ...] = ()) -> dict[str, Any]:
    from moe_launch.trainer.recompute import apply_recompute

    pcfg = ParallelConfig(dp=dp, ep=ep, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual, microbatches=M,
                          optimizer_sharding=strategy)
    groups = build_groups(pcfg)
    torch.manual_seed(SEED)
    pipe = build_pipeline(model_cfg(dispatcher=dispatcher), pcfg, groups)
    apply_recompute(pipe.model, list(recompute))
    opt = build_optimizer(pipe.model, TRAIN, pcfg, groups)
    out: dict[str, Any] = {"losses": [], "aux": [], "z": [], "aux_per_layer": [], "norms": [],
                           "data_rank": groups.data_rank, "ep_rank": groups.ep_rank, "pp_rank": groups.pp_rank}
    for step in range(steps):
        mbs = micro_batches(step, groups.data_size)[groups.data_rank * M : (groups.data_rank + 1) * M]
        loss, parts = pipeline_step(pipe, mbs)
        out["losses"].append(loss.item())
        out["aux"].append(parts.aux_loss.item())
        out["z"].append(parts.z_loss.item())
        out["aux_per_layer"].append([a.item() for a in parts.aux_per_layer])
        opt.reduce_grads()
        out["norms"].append(opt.clip_grad_norm_(TRAIN.grad_clip))
        opt.step(lr_at(step))
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in pipe.model.named_parameters()}
    out["chunks"] = {c: list(pipe.chunk_ranges[c]) for c in pipe.model.chunks}
    return out
