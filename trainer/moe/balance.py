"""Aux-loss-free balancing: after every optimizer step, move each expert's selection bias towards the mean load.

  bias_E += rate * sign(mean_e(load_E) - load_E)
An overloaded expert's bias falls, so fewer tokens pick it next step; an idle one's rises. The bias only shifts the
selection (trainer/moe/router.py); the combine weights and all gradients stay the router's own.

The load is the step's (token, slot) count per expert over every micro-batch, summed over all the ranks that hold
a replica of the router (the DP x EP group of its pipeline stage) before the update: every replica then applies the
same integer-derived step, so the replicas stay bitwise equal without broadcasting the bias.

Shapes: L MoE layers of this model (or pipeline stage), E global experts.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from moe_launch.trainer.moe.router import Router
from moe_launch.trainer.parallel.comm import all_reduce_
from moe_launch.trainer.parallel.groups import Axis


def bias_step_E(load_E: torch.Tensor, rate: float) -> torch.Tensor:
    """The change of the bias for one step's global load (pure). Zero for a perfectly balanced load."""
    load = load_E.double()
    return rate * torch.sign(load.mean() - load)


class BiasBalancer:
    """Owns the bias update of every aux_free_bias router of one model (or pipeline stage)."""

    def __init__(self, routers: list[Router], rate: float, axis: Axis):
        self.routers, self.rate, self.axis = routers, rate, axis

    @classmethod
    def of(cls, model: nn.Module, rate: float, axis: Axis) -> Optional["BiasBalancer"]:
        """None when no router of `model` learns a bias (balance is not aux_free_bias, or a dense model)."""
        routers = [m for m in model.modules() if isinstance(m, Router) and m.expert_bias_E is not None]
        return cls(routers, rate, axis) if routers else None

    @torch.no_grad()
    def update(self, counts_per_layer: list[torch.Tensor]) -> torch.Tensor:
        """`counts_per_layer`: this rank's int64 [E] load of each layer for the step, in the model's layer order.
        Collective over the axis. Returns the global load_LE that was used."""
        if len(counts_per_layer) != len(self.routers):
            raise ValueError(f"{len(counts_per_layer)} load vectors for {len(self.routers)} biased routers")
        load_LE = torch.stack([c.to(torch.int64) for c in counts_per_layer])
        all_reduce_(load_LE, self.axis)  # integer sums: the same result on every replica, in any order
        for router, load_E in zip(self.routers, load_LE):
            bias = router.expert_bias_E
            bias.add_(bias_step_E(load_E, self.rate).to(bias.device, bias.dtype))
        return load_LE


def summed_counts(per_micro_batch: list, n_layers: int) -> list[torch.Tensor]:
    """Per-layer loads of a step from the LossParts of its micro-batches."""
    return [sum(p.counts_per_layer[i] for p in per_micro_batch) for i in range(n_layers)]
