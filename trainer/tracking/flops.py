"""Model FLOPs per token and MFU, PaLM-style: 6 x (active matmul parameters) + 6 x L x S x D for causal attention
(PaLM's 12 x L x S x D halved: a causal mask skips half of the score and value products).

Active parameters count only the top-k experts a token visits (plus the router), which is what an MoE costs
per token; embeddings are a lookup and not counted, the output head is.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from moe_launch.conf.schema import ModelConfig

# Dense bf16 tensor-core peak FLOP/s of one device, from the vendors' data sheets (no sparsity). A device fact, not a
# cluster fact; train.peak_flops overrides it (another dtype, a clock-limited part). First match of the name wins.
SPEC_PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("B200", 2250e12),
)


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


def spec_peak(device_name: str, override: float = 0.0) -> Optional[float]:
    """Peak FLOP/s of one device: `override` (train.peak_flops) when set, else the data-sheet value, else None."""
    if override > 0:
        return override
    return next((peak for key, peak in SPEC_PEAK_BF16 if key in device_name), None)


def measured_gemm_rate(preflight: dict[str, Any], hosts: Iterable[str]) -> Optional[float]:
    """Mean GEMM FLOP/s of one device over the passing compute checks of `hosts` in a preflight.json (the node's
    own rate: what MFU against the hardware actually delivered means). None when no such check ran."""
    hosts = set(hosts)
    rates = [float(r["value"]) * 1e12 for r in preflight.get("results", [])
             if r.get("check") == "compute" and r.get("status") == "pass" and r.get("node") in hosts
             and isinstance(r.get("value"), (int, float)) and r["value"] > 0]
    return sum(rates) / len(rates) if rates else None
