"""Model FLOPs per token and MFU, PaLM-style: 6 x (active matmul parameters) + 6 x L x S x D for causal attention
(PaLM's 12 x L x S x D halved: a causal mask skips half of the score and value products).

Active parameters count only the top-k experts a token visits (plus the router), which is what an MoE costs
per token; embeddings are a lookup and not counted, the output head is.
"""

from __future__ import annotations

from typing import Optional

from moe_launch.conf.schema import ModelConfig


def active_matmul_params(cfg: ModelConfig) -> int:
    D = cfg.d_model
    attn = 4 * D * D
    if cfg.kind == "moe":
        ffn = cfg.moe.top_k * 3 * D * cfg.moe.expert_hidden + cfg.moe.num_experts * D
    else:
        ffn = 3 * D * cfg.ffn_hidden
    return cfg.n_layers * (attn + ffn) + D * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len` (causal attention halved)."""
    return 6.0 * active_matmul_params(cfg) + 6.0 * cfg.n_layers * seq_len * cfg.d_model


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1] over all devices; None without a peak (e.g. on CPU)."""
    if not peak_flops or peak_flops <= 0:
        return None
    return tokens_per_s * flops_per_tok / peak_flops
