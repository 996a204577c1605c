"""OLMo-style dense and OLMoE-style MoE decoder: pre-norm blocks (RMSNorm), attention with QK-norm and RoPE,
SwiGLU feed-forward (dense or MoE), final RMSNorm, untied output head.

Shapes: B batch, S sequence, D model dim, V vocabulary, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_launch.conf.schema import ModelConfig
from moe_launch.errors import DataError
from moe_launch.trainer.model.attention import Attention
from moe_launch.trainer.model.loss import chunked_cross_entropy
from moe_launch.trainer.model.mlp import SwiGLU
from moe_launch.trainer.model.norm import RMSNorm
from moe_launch.trainer.model.rope import Rotary
from moe_launch.trainer.moe.layer import MoELayer, RouterStats


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, ep_rank: int, ep_size: int):
        super().__init__()
        self.is_moe = cfg.kind == "moe"
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rotary)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if self.is_moe:
            self.ffn = MoELayer(cfg.d_model, cfg.moe, ep_rank, ep_size)
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, RouterStats | None]:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        if self.is_moe:
            h_BSD, stats = self.ffn(self.ffn_norm(x_BSD))
            return x_BSD + h_BSD, stats
        return x_BSD + self.ffn(self.ffn_norm(x_BSD)), None


@dataclass
class LossParts:
    """Detached pieces of the loss for logging; tensors, so reading them is the caller's (syncing) choice."""

    lm_loss: torch.Tensor
    aux_loss: torch.Tensor  # coefficient-weighted sum over layers (what was added to the loss)
    z_loss: torch.Tensor  # coefficient-weighted sum over layers
    aux_per_layer: list[torch.Tensor]  # unweighted
    z_per_layer: list[torch.Tensor]  # unweighted
    counts_per_layer: list[torch.Tensor]  # int64 [E] per MoE layer


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        self.cfg = cfg
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.blocks = nn.ModuleList(Block(cfg, self.rotary, ep_rank, ep_size) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward_with_stats(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, list[RouterStats]]:
        h_BSD, stats = self.hidden_with_stats(tokens_BS)
        return self.lm_head(h_BSD), stats

    def hidden_with_stats(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, list[RouterStats]]:
        """The final-normed hidden states (the output head's input) and the router stats of every MoE layer."""
        if tokens_BS.shape[1] > self.cfg.max_seq_len:
            raise DataError(f"sequence length {tokens_BS.shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                            "lower train.seq_len or raise model.max_seq_len")
        x_BSD = self.embed(tokens_BS)
        stats: list[RouterStats] = []
        for block in self.blocks:
            x_BSD, s = block(x_BSD)
            if s is not None:
                stats.append(s)
        return self.norm(x_BSD), stats

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.forward_with_stats(tokens_BS)[0]

    def compute_loss(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, LossParts]:
        """Mean next-token cross-entropy (fp32) + aux_coef * sum_l aux_l + z_coef * sum_l z_l (Megatron's per-layer
        sum). Returns the loss to backpropagate and its detached parts. The head and cross-entropy run chunked over
        tokens (trainer/model/loss.py): the whole batch's logits are never materialised; within fp32 rounding of
        `F.cross_entropy(self(inputs).float(), targets)`."""
        h_BSD, stats = self.hidden_with_stats(inputs_BS)
        lm_loss = chunked_cross_entropy(h_BSD.flatten(0, 1), self.lm_head.weight, targets_BS.flatten(),
                                        fused=self.cfg.cross_entropy_fusion)
        zero = lm_loss.new_zeros(())
        aux = torch.stack([s.aux_loss for s in stats]).sum() * self.cfg.moe.aux_loss_weight if stats else zero
        z = torch.stack([s.z_loss for s in stats]).sum() * self.cfg.moe.z_loss_coef if stats else zero
        parts = LossParts(
            lm_loss=lm_loss.detach(), aux_loss=aux.detach(), z_loss=z.detach(),
            aux_per_layer=[s.aux_loss.detach() for s in stats], z_per_layer=[s.z_loss.detach() for s in stats],
            counts_per_layer=[s.counts_E for s in stats],
        )
        return lm_loss + aux + z, parts
