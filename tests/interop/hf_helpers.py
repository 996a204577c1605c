"""Small random HF OLMoE models for the interop tests (built locally, no network)."""

from __future__ import annotations

import torch


def tiny_olmoe(num_experts: int = 4, top_k: int = 2, norm_topk_prob: bool = False, seed: int = 0,
               n_layers: int = 2, tie: bool = False):
    """A random fp32 OlmoeForCausalLM with non-trivial norm weights and a router that separates experts clearly
    (so top-k choices do not hinge on rounding)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=n_layers,
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
