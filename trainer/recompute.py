"""Selective activation checkpointing, applied to a built model from the outside (`train.recompute`).

    apply_recompute(model, ["norm", "attention", "moe"])   any subset of norm | attention | moe | mlp
    apply_recompute(model, ["full"])                        whole decoder blocks

A recomputed module keeps only its inputs from the forward pass and runs its forward again inside the backward
(torch.utils.checkpoint, non-reentrant: it works with tuple / dataclass outputs such as the MoE layer's RouterStats,
with inputs that need no gradient, and it replays the autocast state). What each kind covers, per block:

    norm       attn_norm and ffn_norm (and the final norm): their fp32 upcast and statistics
    attention  the whole attention module: q/k/v projections, QK-norm, RoPE, softmax attention, output projection
    moe        the MoE layer of MoE blocks: router, expert gather / SwiGLU / combine, and the EP token exchange,
               which therefore runs again in the backward (every EP rank recomputes in the same order, so the
               collectives stay matched)
    mlp        the dense SwiGLU of dense blocks
    full       the whole block (supersedes the others for blocks)

The module's `forward` is replaced on the instance rather than the module being wrapped in a new one: parameter and
buffer names stay exactly those of the unwrapped model, so checkpoints, the optimizer's buckets, the EP dispatchers
and the deterministic per-name initialisation are unaffected. Apply it after the model is built and its dispatchers
are attached; applying it twice to a module is a no-op.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_launch.errors import ConfigError
from moe_launch.trainer.model.norm import RMSNorm
from moe_launch.trainer.model.transformer import Block

KINDS = ("norm", "attention", "moe", "mlp", "full")


def _recompute_forward(module: nn.Module) -> bool:
    """Make `module` recompute its forward in the backward pass. Returns False if it already did."""
    if getattr(module, "_recompute", False):
        return False
    inner = module.forward  # the bound original forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module._recompute = True
    return True


def recompute_targets(model: nn.Module, kinds: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module `kinds` selects in `model` (a Transformer, a pipeline StageModel, or anything
    holding decoder Blocks). Pure: nothing is changed."""
    kinds = list(kinds)
    for i, kind in enumerate(kinds):
        if kind not in KINDS:
            raise ConfigError(f"train.recompute[{i}]", f"got {kind!r}", f"use any of {', '.join(KINDS)}")
    chosen = set(kinds)
    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, Block):
            if "full" in chosen:
                out.append((name, module))
                continue
            if "norm" in chosen:
                out += [(f"{name}.attn_norm", module.attn_norm), (f"{name}.ffn_norm", module.ffn_norm)]
            if "attention" in chosen:
                out.append((f"{name}.attn", module.attn))
            if ("moe" in chosen and module.is_moe) or ("mlp" in chosen and not module.is_moe):
                out.append((f"{name}.ffn", module.ffn))
    final_norm = getattr(model, "norm", None)
    if "norm" in chosen and isinstance(final_norm, RMSNorm):
        out.append(("norm", final_norm))
    return out


def apply_recompute(model: nn.Module, kinds: Iterable[str]) -> list[str]:
    """Checkpoint the modules `kinds` selects (train.recompute); returns the names of the modules changed now.
    An empty `kinds` changes nothing."""
    return [name for name, module in recompute_targets(model, kinds) if _recompute_forward(module)]
