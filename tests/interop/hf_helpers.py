"""Small random HF OLMoE models for the interop tests (built locally, no network)."""

from __future__ import annotations

import torch


def tiny_olmoe(num_experts: int = 4, top_k: int = 2, norm_topk_prob: bool = False, seed: int = 0,
               n_layers: int = 2, tie: bool = False, vocab: int = 96):
    """A random fp32 OlmoeForCausalLM with non-trivial norm weights and a router that separates experts clearly
    (so top-k choices do not hinge on rounding)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=24, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=4, num_experts=num_experts,
                      num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, max_position_embeddings=64,
                      rope_theta=5000.0, rms_norm_eps=1e-6, pad_token_id=None, eos_token_id=None,
                      tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = OlmoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.2)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def random_token_dataset(out_dir, seq_len: int, vocab: int, rows: int = 64, seed: int = 0) -> str:
    """A prepared npy dataset (trainer/data/shards.py format) of random tokens: lets a trainer test skip the
    built-in corpus's tokenizer training."""
    from pathlib import Path

    import numpy as np

    from moe_launch.trainer.data.shards import ShardIndex, token_dtype, write_index, write_shard

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows_NL = np.random.default_rng(seed).integers(0, vocab, (rows, seq_len + 1)).astype(token_dtype(vocab))
    write_shard(out, 0, rows_NL)
    write_index(out, ShardIndex(seq_len=seq_len, dtype=str(rows_NL.dtype), vocab_size=vocab, eos_id=0,
                                max_token_id=int(rows_NL.max()), shards=[{"file": "shard-00000.npy", "count": rows}],
                                tokenizer="random", seed=seed, shard_size=rows, total_tokens=int(rows_NL.size)))
    return str(out)
