"""All-gather token exchange (Optimus, FastSparseMoE stages 1 and 5).

Every EP rank receives every rank's tokens and routing (regular, uniform traffic instead of an irregular
all-to-all), runs its local experts on the pairs routed to them (pairs for other ranks' experts contribute zero),
and the partial outputs are reduce-scattered back to the ranks that own the tokens, which sums each token's
top-k contributions across ranks.

Shapes: T tokens on this rank, R = ep*T tokens of the EP group, D model dim, K top-k.
Forward traffic per rank: (ep-1)*T*(D + 2K) elements in, (ep-1)*T*D out; backward the same in reverse.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_launch.trainer.parallel.autograd_comm import all_gather_rows, keep_in_graph, reduce_scatter_rows
from moe_launch.trainer.parallel.groups import Axis


class AllGatherDispatch:
    def __init__(self, ep: Axis):
        self.ep = ep

    def __call__(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor, layer: Any) -> torch.Tensor:
        # every rank of the EP group must bring the same T (same micro-batch shape): the collectives need equal rows
        x_RD, w_RK = all_gather_rows(self.ep, x_TD, w_TK)  # one node: one backward order on every rank
        (idx_RK,) = all_gather_rows(self.ep, idx_TK)
        y_RD = layer.experts_fn(x_RD, idx_RK, w_RK, layer.w_gate_EFD, layer.w_up_EFD, layer.w_down_EDF,
                                e_start=layer.e_start)
        y_RD = keep_in_graph(y_RD, x_RD, w_RK)  # no local pairs: still join the backward reduce-scatter
        return reduce_scatter_rows(y_RD, self.ep)

    def __repr__(self) -> str:
        return f"AllGatherDispatch(ep={self.ep.size})"
