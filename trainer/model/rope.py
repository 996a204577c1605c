"""Rotary position embeddings in the "rotate half" layout that OLMo / OLMoE (and HF Llama) use.

Shapes: B batch, H heads, S sequence, Dh head dim (even).
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        inv_freq_P = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles_SP = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq_P)
        angles_SDh = torch.cat([angles_SP, angles_SP], dim=-1)
        # not persistent: derived from the config, so checkpoints stay independent of max_seq_len
        self.register_buffer("cos_SDh", angles_SDh.cos().float(), persistent=False)
        self.register_buffer("sin_SDh", angles_SDh.sin().float(), persistent=False)

    def forward(self, x_BHSDh: torch.Tensor) -> torch.Tensor:
        S = x_BHSDh.shape[-2]
        cos, sin = self.cos_SDh[:S], self.sin_SDh[:S]
        x = x_BHSDh.float()
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * cos + rotated * sin).to(x_BHSDh.dtype)
