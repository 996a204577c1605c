"""OLMo / OLMoE decoders. `build_model` is the one entry the rest of the trainer (and trainer/parallel) uses."""

from __future__ import annotations

from typing import Optional

import torch

from moe_launch.conf.schema import ModelConfig
from moe_launch.trainer.model.init import init_weights
from moe_launch.trainer.model.transformer import LossParts, Transformer

__all__ = ["build_model", "Transformer", "LossParts"]


def build_model(model_cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1,
                device: Optional[torch.device | str] = None) -> Transformer:
    """Dense or MoE decoder (by model_cfg.kind) holding the local experts [ep_rank*E/ep, (ep_rank+1)*E/ep).

    The base seed of the initialisation is drawn from torch's global generator, so `torch.manual_seed(s)` before
    the call fixes the model; for the same seed every ep_size yields slices of the same global experts.
    model_cfg.init_from is not applied here: loading weights is the checkpoint module's job (trainer/checkpoint).
    """
    base_seed = int(torch.randint(0, 2**62, (1,)).item())
    with torch.device(device or "cpu"):
        model = Transformer(model_cfg, ep_rank=ep_rank, ep_size=ep_size)
    init_weights(model, model_cfg.init_std, base_seed)
    return model
