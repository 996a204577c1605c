"""All-to-all token exchange (Megatron-style), dropless.

1. Each (token, k) pair goes to the EP rank owning its expert: dest = idx // E_local. Pairs are sorted by
   destination (stable, so the order is deterministic) and the per-destination counts exchanged (a host sync: the
   variable all-to-all needs the split sizes on the host).
2. A variable all-to-all sends each pair's token row and its expert index; the receiver runs its local experts on
   the received rows (one pair per row, weight 1).
3. The reverse all-to-all brings each pair's expert output home, where it is weighted by its top-k weight and
   summed into its token (index_add: deterministic on CPU; the weights stay local, so their gradient does too).

Shapes: T tokens, K top-k, P = T*K pairs sent by this rank, Q pairs received, D model dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moe_launch.trainer.parallel.autograd_comm import all_to_all_rows, keep_in_graph
from moe_launch.trainer.parallel.groups import Axis


def exchange_counts(send_counts_R: torch.Tensor, ep: Axis) -> torch.Tensor:
    """recv[j] = how many rows rank j sends to me."""
    recv_counts_R = torch.empty_like(send_counts_R)
    dist.all_to_all_single(recv_counts_R, send_counts_R, group=ep.group)
    return recv_counts_R


class AllToAllDispatch:
    def __init__(self, ep: Axis):
        self.ep = ep

    def __call__(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor, layer: Any) -> torch.Tensor:
        T, K = idx_TK.shape
        E_local = layer.w_gate_EFD.shape[0]
        idx_P = idx_TK.reshape(-1)
        dest_P = torch.div(idx_P, E_local, rounding_mode="floor")
        order_P = torch.argsort(dest_P, stable=True)
        token_P = order_P // K  # the token of each pair, in send order
        send_counts = torch.bincount(dest_P, minlength=self.ep.size)
        recv_counts = exchange_counts(send_counts, self.ep)
        send_rows, recv_rows = send_counts.tolist(), recv_counts.tolist()  # note: host sync point

        x_PD = x_TD.index_select(0, token_P)
        x_QD = all_to_all_rows(x_PD, recv_rows, send_rows, self.ep)
        idx_Q1 = all_to_all_rows(idx_P.index_select(0, order_P), recv_rows, send_rows, self.ep).unsqueeze(1)
        ones_Q1 = torch.ones(idx_Q1.shape, dtype=w_TK.dtype, device=w_TK.device)
        y_QD = layer.experts_fn(x_QD, idx_Q1, ones_Q1, layer.w_gate_EFD, layer.w_up_EFD, layer.w_down_EDF,
                                e_start=layer.e_start)
        y_QD = keep_in_graph(y_QD, x_QD)  # nothing received: still join both backward all-to-alls
        y_PD = all_to_all_rows(y_QD, send_rows, recv_rows, self.ep)

        w_P1 = w_TK.reshape(-1).index_select(0, order_P).unsqueeze(1).to(y_PD.dtype)
        return torch.zeros_like(x_TD).index_add(0, token_P, y_PD * w_P1)

    def __repr__(self) -> str:
        return f"AllToAllDispatch(ep={self.ep.size})"
