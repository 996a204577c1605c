"""Causal self-attention with OLMoE's QK-norm (RMSNorm over the full q and k projections, before RoPE).

Shapes: B batch, S sequence, D model dim, H heads, Dh head dim. Attention runs through
`scaled_dot_product_attention`, which picks flash / memory-efficient kernels on GPU and the math path on CPU.
On CUDA with `model.qk_norm_rope_fusion` (the default) the norm and the rotation of q (and of k) are one Triton kernel
(kernels/norm_rope.py), whose backward is one pass where the compiled modules take two; the norms' weights stay the
`q_norm` / `k_norm` modules' parameters, so checkpoints and initialisation do not depend on the setting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_launch.conf.schema import ModelConfig
from moe_launch.trainer.model.norm import RMSNorm
from moe_launch.trainer.model.rope import Rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        D = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.q_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.rotary = rotary  # shared buffers; registered once on the Transformer
        self.fuse_norm_rope = cfg.qk_norm and cfg.qk_norm_rope_fusion

    def _heads(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        return x_BSD.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)

    def _norm_rope(self, x_BSD: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if self.fuse_norm_rope and x_BSD.is_cuda:
            from moe_launch.kernels.norm_rope import norm_rope  # imported lazily: triton is optional off CUDA
            S = x_BSD.shape[1]
            return self._heads(norm_rope(x_BSD, norm.weight, norm.eps, self.rotary.cos_SDh[:S],
                                         self.rotary.sin_signed_SDh[:S]))
        return self.rotary(self._heads(norm(x_BSD)))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q_BHSDh = self._norm_rope(self.q_proj(x_BSD), self.q_norm)
        k_BHSDh = self._norm_rope(self.k_proj(x_BSD), self.k_norm)
        v_BHSDh = self._heads(self.v_proj(x_BSD))
        o_BHSDh = F.scaled_dot_product_attention(q_BHSDh, k_BHSDh, v_BHSDh, is_causal=True)
        return self.o_proj(o_BHSDh.transpose(1, 2).reshape(B, S, D))
