"""Token-choice top-k router: linear -> softmax in fp32 -> top-k, optionally renormalised.

Shapes: T tokens, D model dim, E global experts, K top-k.
Forced uniform routing (model.moe.uniform_routing) replaces the top-k choice by a fixed round-robin assignment in
which every expert receives exactly T*K/E (token, slot) pairs; the weights still come from the router's
probabilities so gradients keep flowing. It exists to benchmark kernels and dispatchers without load imbalance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_launch.conf.schema import MoEConfig


@dataclass
class Routing:
    idx_TK: torch.Tensor  # int64 global expert ids
    w_TK: torch.Tensor  # fp32 combine weights
    logits_TE: torch.Tensor  # fp32
    probs_TE: torch.Tensor  # fp32


def uniform_assignment(T: int, K: int, E: int, device: torch.device) -> torch.Tensor:
    """Slot k of token t goes to expert (t*K + k) mod E: K distinct experts per token, balanced counts."""
    return (torch.arange(T, device=device).unsqueeze(1) * K + torch.arange(K, device=device)) % E


class Router(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.norm_topk_prob, self.uniform = cfg.norm_topk_prob, cfg.uniform_routing
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))

    def forward(self, x_TD: torch.Tensor) -> Routing:
        # fp32 logits even under bf16 autocast: the softmax and the z-loss are sensitive to rounding
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.weight.float())
        probs_TE = logits_TE.softmax(dim=-1)
        if self.uniform:
            idx_TK = uniform_assignment(x_TD.shape[0], self.top_k, self.num_experts, x_TD.device)
            w_TK = probs_TE.gather(1, idx_TK)
        else:
            w_TK, idx_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
        return Routing(idx_TK=idx_TK, w_TK=w_TK, logits_TE=logits_TE, probs_TE=probs_TE)
