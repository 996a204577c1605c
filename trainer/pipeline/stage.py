"""The part of the decoder one pipeline stage holds: its chunks' blocks, plus the embedding (chunk 0) and the final
norm + output head (last chunk).

Parameter names are the full model's (`embed.weight`, `blocks.5.attn.q_proj.weight`, `lm_head.weight`): the blocks
sit in a ModuleDict keyed by their global layer index. So the deterministic per-name initialisation
(trainer/model/init.py) gives every stage exactly its slice of the PP=1 model, a stage's state dict is a subset of the
full one, and optimizers / checkpoints / recompute work on a StageModel as on a Transformer.

Shapes: B batch (micro-batch), S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from moe_launch.conf.schema import ModelConfig
from moe_launch.errors import ConfigError, DataError
from moe_launch.trainer.model.init import init_weights
from moe_launch.trainer.model.loss import chunked_cross_entropy
from moe_launch.trainer.model.norm import RMSNorm
from moe_launch.trainer.model.rope import Rotary
from moe_launch.trainer.model.transformer import Block
from moe_launch.trainer.moe.layer import RouterStats


@dataclass
class ChunkOut:
    """One chunk's forward on one micro-batch."""

    out: torch.Tensor  # x_BSD for the next chunk, or the scalar lm loss on the last chunk
    layers: list[int]  # global indices of this chunk's MoE layers, in order
    stats: list[RouterStats]  # their router statistics (aux / z losses carry gradients)


class StageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, chunk_ranges: dict[int, range], n_chunks: int, ep_rank: int = 0,
                 ep_size: int = 1):
        super().__init__()
        self.cfg = cfg
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.chunk_ranges = dict(chunk_ranges)  # global chunk index -> its layers
        self.first_chunk, self.last_chunk = 0, n_chunks - 1
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        if self.first_chunk in self.chunk_ranges:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, self.rotary, ep_rank, ep_size)
                                     for c in sorted(self.chunk_ranges) for i in self.chunk_ranges[c]})
        if self.last_chunk in self.chunk_ranges:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def chunks(self) -> list[int]:
        return sorted(self.chunk_ranges)

    def forward_chunk(self, chunk: int, x: torch.Tensor, targets_BS: Optional[torch.Tensor] = None) -> ChunkOut:
        """Chunk 0 takes tokens_BS, the others x_BSD. The last chunk returns the mean next-token cross-entropy
        (fp32) of `targets_BS`, the others the residual stream x_BSD."""
        if chunk == self.first_chunk:
            if x.shape[1] > self.cfg.max_seq_len:
                raise DataError(f"sequence length {x.shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                                "lower train.seq_len or raise model.max_seq_len")
            x = self.embed(x)
        layers, stats = [], []
        for i in self.chunk_ranges[chunk]:
            x, s = self.blocks[str(i)](x)
            if s is not None:
                layers.append(i)
                stats.append(s)
        if chunk == self.last_chunk:
            # head + cross-entropy chunked over tokens, as Transformer.compute_loss: no full fp32 logits
            x = chunked_cross_entropy(self.norm(x).flatten(0, 1), self.lm_head.weight, targets_BS.flatten(),
                                      fused=self.cfg.cross_entropy_fusion)
        return ChunkOut(out=x, layers=layers, stats=stats)


def parameter_counts(cfg: ModelConfig) -> tuple[list[int], int, int]:
    """(params per layer, embedding params, final norm + head params) of the full model (all experts), computed on
    the meta device: nothing is allocated."""
    with torch.device("meta"):
        rotary = Rotary(cfg.head_dim, 2, cfg.rope_theta)
        block = Block(cfg, rotary, 0, 1)
    per_layer = sum(p.numel() for p in block.parameters())
    embed = cfg.vocab_size * cfg.d_model
    head = cfg.vocab_size * cfg.d_model + cfg.d_model
    return [per_layer] * cfg.n_layers, embed, head


def forward_flops(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float, float]:
    """(per layer, embedding, final norm + head) forward FLOPs per token: projections 2*4*D^2, causal attention
    2*S*D, router 2*D*E and top-k SwiGLU experts 3*2*D*F*K (MoE) or 3*2*D*H (dense); head 2*D*V."""
    D = cfg.d_model
    ffn = (2 * D * cfg.moe.num_experts + 6 * D * cfg.moe.expert_hidden * cfg.moe.top_k if cfg.kind == "moe"
           else 6 * D * cfg.ffn_hidden)
    layer = 8 * D * D + 2 * seq_len * D + ffn
    return [float(layer)] * cfg.n_layers, 0.0, float(2 * D * cfg.vocab_size)


def balance_costs(cfg: ModelConfig, balance: str) -> tuple[list[float], float, float]:
    """(per layer, embedding, head) costs that `parallel.pp_balance` balances (see split.py)."""
    if balance == "flops":
        return forward_flops(cfg, cfg.max_seq_len)
    if balance == "params":
        layers, embed, head = parameter_counts(cfg)
        return [float(n) for n in layers], float(embed), float(head)
    if balance == "layers":
        return [1.0] * cfg.n_layers, 0.0, 0.0
    raise ConfigError("parallel.pp_balance", f"got {balance!r}", "use flops, params or layers")


def build_stage_model(cfg: ModelConfig, chunk_ranges: dict[int, range], n_chunks: int, ep_rank: int = 0,
                      ep_size: int = 1, device: Optional[torch.device | str] = None) -> StageModel:
    """The stage's parameters, initialised exactly as `trainer.model.build_model` initialises the same names: the
    base seed is drawn from torch's global generator in the same way, so `torch.manual_seed(s)` before this call on
    every stage gives the slices of the PP=1 model built after the same seed (tests/pipeline checks it)."""
    base_seed = int(torch.randint(0, 2**62, (1,)).item())
    with torch.device(device or "cpu"):
        model = StageModel(cfg, chunk_ranges, n_chunks, ep_rank, ep_size)
    init_weights(model, cfg.init_std, base_seed)
    return model
