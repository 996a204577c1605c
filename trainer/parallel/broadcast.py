"""Load once, broadcast: only the first DP member reads the weights from the file system; the others receive them.

Expert parameters differ across EP ranks, so each is broadcast within its DP group (from dp_rank 0, which holds the
same experts); everything else is replicated over DP × EP and is broadcast within the DP × EP group. Buffers
(rotary tables and the like) follow the non-expert rule.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_launch.trainer.parallel.comm import broadcast_
from moe_launch.trainer.parallel.groups import Groups


@torch.no_grad()
def broadcast_model(model: nn.Module, groups: Groups) -> None:
    """Collective over the DP × EP group: every rank calls it after the source ranks (dp_rank 0; data_rank 0 for
    non-expert tensors) have loaded or initialised their weights."""
    for _, p in model.named_parameters():
        axis = groups.dp if getattr(p, "_moe_expert", False) else groups.dp_ep
        broadcast_(p.data, axis, src_index=0)
    for _, b in model.named_buffers():
        broadcast_(b, groups.dp_ep, src_index=0)
