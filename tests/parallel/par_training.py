"""A few optimizer steps of the real model (trainer/model) on one process or under DP × EP, for comparison.

The single-process reference runs the same global batch as data_size micro-batches with gradient accumulation
(loss / data_size each), which is what the parallel run computes: each data rank takes micro-batch data_rank.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_launch.conf.schema import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_launch.trainer.model import build_model
from moe_launch.trainer.parallel.broadcast import broadcast_model
from moe_launch.trainer.parallel.dispatch import attach_dispatchers
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import build_optimizer

SEED, SEQ, MBS = 7, 8, 2
MICRO_BATCHES = 4  # the global batch: 4 micro-batches of MBS sequences, split over the data ranks
TRAIN = TrainConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.5, global_batch_size=8, micro_batch_size=MBS, seq_len=SEQ)


def tiny_model_cfg(dispatcher: str = "allgather") -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=8, dispatcher=dispatcher))


def batch(step: int, micro_batches: int) -> torch.Tensor:
    """The global batch of a step: [micro_batches * MBS, SEQ + 1] tokens."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, 64, (micro_batches * MBS, SEQ + 1), generator=g)


def lr_at(step: int) -> float:
    return TRAIN.lr * (step + 1) / 3


def reference_run(steps: int, data_size: int = MICRO_BATCHES) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = build_model(tiny_model_cfg())
    groups = build_groups(ParallelConfig())
    opt = build_optimizer(model, TRAIN, ParallelConfig(), groups)
    losses, norms = [], []
    for step in range(steps):
        tokens = batch(step, data_size)
        per_micro = []
        for i in range(data_size):
            mb = tokens[i * MBS : (i + 1) * MBS]
            loss, _ = model.compute_loss(mb[:, :-1], mb[:, 1:])
            (loss / data_size).backward()
            per_micro.append(loss.item())
        opt.reduce_grads()
        norms.append(opt.clip_grad_norm_(TRAIN.grad_clip))
        opt.step(lr_at(step))
        opt.zero_grad()
        losses.append(per_micro)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def parallel_setup(dp: int, ep: int, strategy: str, dispatcher: str, perturb_non_source: bool = True):
    pcfg = ParallelConfig(dp=dp, ep=ep, optimizer_sharding=strategy)
    groups = build_groups(pcfg)
    torch.manual_seed(SEED if groups.dp_rank == 0 or not perturb_non_source else SEED + 1 + groups.world_rank)
    # ranks other than the broadcast sources start from different weights: the broadcast must fix that
    model = build_model(tiny_model_cfg(dispatcher), ep_rank=groups.ep_rank, ep_size=groups.ep_size)
    broadcast_model(model, groups)
    attach_dispatchers(model, tiny_model_cfg(dispatcher), groups)
    opt = build_optimizer(model, TRAIN, pcfg, groups)
    return groups, model, opt


def parallel_steps(groups, model, opt, first_step: int, steps: int) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        tokens = batch(step, MICRO_BATCHES)
        accum = MICRO_BATCHES // groups.data_size  # fewer data ranks: each accumulates more micro-batches
        step_loss = 0.0
        for j in range(accum):
            i = groups.data_rank * accum + j
            mb = tokens[i * MBS : (i + 1) * MBS]
            loss, _ = model.compute_loss(mb[:, :-1], mb[:, 1:])
            (loss / accum).backward()
            step_loss += loss.item() / accum
        opt.reduce_grads()
        norms.append(opt.clip_grad_norm_(TRAIN.grad_clip))
        opt.step(lr_at(step))
        opt.zero_grad()
        losses.append(step_loss)
    return losses, norms


def parallel_run(dp: int, ep: int, strategy: str, dispatcher: str, steps: int) -> dict[str, Any]:
    groups, model, opt = parallel_setup(dp, ep, strategy, dispatcher)
    losses, norms = parallel_steps(groups, model, opt, 0, steps)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "data_rank": groups.data_rank, "ep_rank": groups.ep_rank, "state_bytes": opt.optimizer_state_bytes(),
            "expert_numel": sum(p.numel() for p in model.parameters() if getattr(p, "_moe_expert", False)),
            "dense_numel": sum(p.numel() for p in model.parameters() if not getattr(p, "_moe_expert", False))}
