"""Model FLOPs per token and MFU, PaLM-style: 6 x (active matmul parameters) + 6 x L x S x D for causal attention
(PaLM's 12 x L x S x D halved: a causal mask skips half of the score and value products; Megatron-LM and torchtitan
keep the 12, which flops_per_token(causal=False) gives for comparisons).

Active parameters count only the top-k experts a token visits (plus the router), which is what an MoE costs
per token; embeddings are a lookup and not counted, the output head is.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from moe_launch.conf.schema import ModelConfig

# Dense bf16 and FP8 tensor-core peak FLOP/s of one device, from the vendors' data sheets (no sparsity). A device
# fact, not a cluster fact; train.peak_flops overrides it (a clock-limited part). First match of the name wins.
SPEC_PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("B200", 2250e12),
)
SPEC_PEAK_FP8 = (
    ("H100 PCIe", 1513e12),
    ("H100", 1979e12),
    ("H200", 1979e12),
    ("H800", 1979e12),
    ("B200", 4500e12),
)


def active_matmul_params(cfg: ModelConfig) -> int:
    D = cfg.d_model
    attn = 4 * D * D
    if cfg.kind == "moe":
        ffn = cfg.moe.top_k * 3 * D * cfg.moe.expert_hidden + cfg.moe.num_experts * D
    else:
        ffn = 3 * D * cfg.ffn_hidden
    return cfg.n_layers * (attn + ffn) + D * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`, causal attention halved.
    causal=False counts the score and value products the mask skips too, as Megatron-LM's and torchtitan's MFU do:
    only for comparing with figures quoted that way; the trainer's metrics never use it."""
    attention = (6.0 if causal else 12.0) * cfg.n_layers * seq_len * cfg.d_model
    return 6.0 * active_matmul_params(cfg) + attention


def fp8_flops_per_token(cfg: ModelConfig) -> float:
    """The part of flops_per_token that runs in FP8 with model.moe.precision=fp8: the routed experts' forward and
    activation-gradient GEMMs, 4 of their 6 matmul passes (the weight gradients stay bf16, kernels/moe.py); 0 else."""
    if cfg.kind != "moe" or cfg.moe.precision != "fp8":
        return 0.0
    return 4.0 * cfg.n_layers * cfg.moe.top_k * 3 * cfg.d_model * cfg.moe.expert_hidden


def step_peak(cfg: ModelConfig, seq_len: int, device_name: str, override: float = 0.0) -> Optional[float]:
    """The data-sheet peak a step of this model is measured against: `override` (train.peak_flops) when set; else
    the bf16 peak, or, with FP8 experts, the rate at which the step's FLOPs would run with each part at its own
    precision's peak (FLOPs / (bf16 FLOPs / bf16 peak + FP8 FLOPs / FP8 peak)). None for an unknown device."""
    bf16 = spec_peak(device_name, override)
    f8 = fp8_flops_per_token(cfg)
    if override > 0 or bf16 is None or f8 == 0:
        return bf16
    fp8 = next((peak for key, peak in SPEC_PEAK_FP8 if key in device_name), None)
    if fp8 is None:
        return bf16
    total = flops_per_token(cfg, seq_len)
    return total / ((total - f8) / bf16 + f8 / fp8)


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
