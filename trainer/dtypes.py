"""The trainer's numerics set-up: deterministic mode, the compute dtype, the parameters' dtype, and the cast of a built
model's parameters into it."""

from __future__ import annotations

import torch

from moe_launch.errors import ConfigError


def set_determinism(deterministic: bool, device: torch.device) -> None:
    """CPU: bitwise repeatable (tested). GPU: needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set before CUDA starts, and pins
    NCCL_ALGO=Ring (__main__ does both). Measured on one H200 (benchmarks/stability.py, RESULTS.md): two 50-step runs,
    and one interrupted and resumed at step 25, end with bitwise-equal parameters and optimizer state, with the
    FastSparseMoE kernels and fused AdamW (they use no atomics, so deterministic mode keeps them) as with the
    reference experts. Caveats: torch raises (warn_only=False) for an op without a deterministic CUDA kernel rather
    than letting runs drift; a different GPU count, GPU model or library version is outside the guarantee."""
    torch.use_deterministic_algorithms(deterministic)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic
        torch.backends.cuda.matmul.allow_tf32 = not deterministic


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if setting == "bf16" else torch.float32


def param_dtype(setting: str, compute: torch.dtype) -> torch.dtype:
    """The parameters' dtype for `train.param_dtype` given the resolved compute dtype: auto follows the compute dtype
    (bf16 compute -> bf16 weights, the fp32 master copy lives in the optimizer). The config check can only reject
    train.dtype=fp32 explicitly; train.dtype=auto resolves to fp32 on CPU, which is caught here."""
    if setting == "auto":
        return compute
    if setting == "bf16" and compute != torch.bfloat16:
        raise ConfigError("train.param_dtype", "bf16 parameters need bf16 compute, but train.dtype resolves to "
                          f"{compute} on this device", "set train.dtype=bf16, or train.param_dtype=fp32 / auto")
    return torch.bfloat16 if setting == "bf16" else torch.float32


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters only, in place (same Parameter objects: names, flags such as _moe_expert, and whatever
    holds a reference keep working). Buffers keep their dtype: the rotary cos/sin tables stay fp32."""
    for p in model.parameters():
        if p.dtype != dtype and p.requires_grad:  # no-gradient state (the routers' expert bias) keeps its fp32
            p.data = p.data.to(dtype)
