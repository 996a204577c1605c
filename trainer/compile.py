"""torch.compile of the dense parts of the decoder (`train.compile`), applied to a built model from the outside.

    compile_model(model)    every block's attn_norm, attention and ffn_norm, and the final norm

What is compiled, per block: the attention sublayer's norm (`attn_norm`) and the attention module (q/k/v projections,
QK-norm, RoPE, SDPA, output projection), and the `ffn_norm`. These are chains of element-wise passes around a few
GEMMs: eager runs each norm / RoPE step as its own kernel over the full activation (with fp32 intermediates), which
Inductor fuses into a handful of kernels, forward and backward. SDPA stays the flash / efficient attention kernel
(Inductor keeps it as an extern call). What is NOT compiled: the MoE layer (our Triton kernels and custom autograd
Functions, with data-dependent token counts per expert) and the dense SwiGLU (two GEMMs and one product: nothing to
fuse), the embedding and the chunked output head + cross-entropy.

Why these modules rather than whole blocks: compiling a whole block would trace into the MoE layer, and the blocks'
modules are exactly the units `train.recompute` (trainer/recompute.py) wraps. Each module is compiled IN PLACE
(`nn.Module.compile`), so parameter and buffer names, state dicts, the optimizer's buckets and the per-name
initialisation are those of the uncompiled model. Recompute composes in either order: recompute replaces the
instance's `forward` with a non-reentrant checkpoint; the compiled `__call__` traces whatever `forward` the instance
has (Dynamo guards on it), so a checkpointed sublayer is traced with its checkpoint (a recompute region of the
compiled graph: only the sublayer's input is kept, as eager recompute does), and a checkpointed whole block ("full")
simply calls the compiled modules again in its backward.

Shapes and recompiles: the trainer runs fixed shapes (micro-batch x seq_len), so everything is compiled with
`dynamic=False`. Dynamo treats the modules' parameters as graph inputs, so every block reuses one graph per module
class (tests/perf/test_compile.py checks: 2 graphs for any depth, no graph breaks); recompute adds one more per
class. The recompile limit is raised anyway, so that a torch version that specialises on module instances compiles
every layer instead of silently running the deep ones eager.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from moe_launch.trainer.model.norm import RMSNorm
from moe_launch.trainer.model.transformer import Block

# A 16-layer model presents 3 * 16 + 1 module instances of two classes: room for one entry each, should Dynamo ever
# specialise on instances (past the limit it would run the remaining layers eager, with only a log warning).
_MIN_CACHE_LIMIT = 256


def compile_enabled(setting: Optional[bool], device: torch.device) -> bool:
    """`train.compile`: None (the default) compiles on CUDA only. On CPU Inductor generates and builds C++ with the
    system compiler, which costs more than the small models trained there ever win back."""
    return device.type == "cuda" if setting is None else setting


def compile_cache_env(run_root: Path) -> dict[str, str]:
    """Environment that keeps compiled code in the run directory: Inductor's FX-graph and AOTAutograd caches (the
    generated kernels of torch.compile) and Triton's kernel cache (the binaries of those kernels and of kernels/).
    A restarted trainer, on this node or a buffer node sharing the run directory, then loads what the first attempt
    compiled instead of generating and building it again; only Dynamo's tracing is redone. Pure; the caller sets the
    variables the user has not set, before anything compiles (both caches read them when first used)."""
    cache = run_root / "compile_cache"
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def compile_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module `compile_model` compiles in `model` (a Transformer, a pipeline StageModel, or
    anything holding decoder Blocks). Pure: nothing is changed."""
    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, Block):
            out += [(f"{name}.attn_norm", module.attn_norm), (f"{name}.attn", module.attn),
                    (f"{name}.ffn_norm", module.ffn_norm)]
    final_norm = getattr(model, "norm", None)  # a pipeline stage has it on its last chunk only
    if isinstance(final_norm, RMSNorm):
        out.append(("norm", final_norm))
    return out


def _raise_cache_limits(n_targets: int) -> None:
    cfg = torch._dynamo.config
    want = max(_MIN_CACHE_LIMIT, 2 * n_targets)
    # the name changed over versions (cache_size_limit -> recompile_limit); set whichever this torch has
    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, key) and getattr(cfg, key) < want:
            setattr(cfg, key, want)


def compile_model(model: nn.Module) -> None:
    """Compile, in place, the dense parts of every decoder block of `model` and its final norm (see the module
    docstring). Call it after the model is built and its EP dispatchers attached, before or after `apply_recompute`.
    Tracing happens at the first forward, so parameters may still be cast / loaded in between (the Trainer casts
    them to train.param_dtype afterwards). Compiling twice is a no-op."""
    targets = compile_targets(model)
    _raise_cache_limits(len(targets))
    for _name, module in targets:
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile(dynamic=False)
