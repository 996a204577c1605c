"""Deterministic, parallelism-independent initialisation.

Every parameter is drawn from its own generator seeded by (base seed, parameter name) and, for expert weights,
by the GLOBAL expert index. So a model built with ep_size > 1 holds exactly the slice of the ep_size = 1 model's
experts, and the result does not depend on construction order or on which device builds it.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from moe_launch.trainer.model.norm import RMSNorm


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def _normal(shape: torch.Size, std: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


@torch.no_grad()
def init_weights(model: nn.Module, std: float, base_seed: int) -> None:
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, p in model.named_parameters():
        if id(p) in norm_weights:
            p.fill_(1.0)
        elif not p.requires_grad:  # state moved by a rule, not by gradients (the routers' expert bias): neutral
            p.zero_()
        elif getattr(p, "_moe_expert", False):
            layer = model.get_submodule(name.rsplit(".", 1)[0])
            for e in range(p.shape[0]):
                p[e].copy_(_normal(p.shape[1:], std, _seed(base_seed, name, layer.e_start + e)))
        else:
            p.copy_(_normal(p.shape, std, _seed(base_seed, name)))
