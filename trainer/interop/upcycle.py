"""Dense -> MoE upcycling (Komatsuzaki et al., "Sparse Upcycling"): every expert starts as a copy of the dense FFN.

The expert copies come from trainer/model/upcycle.py (`upcycle_dense_state`, the trainer's own name map); this
module adds what a usable MoE start needs and where it comes from:
  * the router: zero (default) or small normal weights, identical on every EP rank (it is replicated);
  * output preservation: with a zero router every expert gets probability 1/E, so top-k combine weights sum to K/E
    unless model.moe.norm_topk_prob renormalises them to 1. Scaling each expert's down projection by E/K makes the
    upcycled model compute exactly the dense function at step 0 (with a non-zero router only approximately);
  * sources: a dense state dict, a dense checkpoint directory (any DP layout), or an HF 1-expert OLMoE export.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from moe_launch.conf.schema import ModelConfig
from moe_launch.errors import ConfigError
from moe_launch.trainer.interop.gather import full_state_from_checkpoint, write_model_checkpoint
from moe_launch.trainer.model.upcycle import upcycle_dense_state


def _check_shapes(dense_cfg: ModelConfig, moe_cfg: ModelConfig) -> None:
    if moe_cfg.kind != "moe":
        raise ConfigError("model.kind", f"upcycling needs an MoE target, got {moe_cfg.kind!r}", "set model.kind=moe")
    if moe_cfg.moe.expert_hidden != dense_cfg.ffn_hidden:
        raise ConfigError("model.moe.expert_hidden", f"is {moe_cfg.moe.expert_hidden}, the dense FFN has "
                          f"{dense_cfg.ffn_hidden}", f"set model.moe.expert_hidden={dense_cfg.ffn_hidden}")
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "qk_norm"):
        if getattr(dense_cfg, key) != getattr(moe_cfg, key):
            raise ConfigError(f"model.{key}", f"is {getattr(moe_cfg, key)!r}, the dense model has "
                              f"{getattr(dense_cfg, key)!r}", "upcycle into the same attention/embedding shapes")


def upcycle_state(dense_state: dict[str, torch.Tensor], moe_cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1,
                  router_std: float = 0.0, seed: int = 0, preserve_output: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of EP rank `ep_rank` of an MoE model whose experts all equal the dense FFN.

    preserve_output scales the experts' down projections by E/K when the combine weights are not renormalised
    (see the module docstring); it is exact for router_std=0.
    """
    E, K = moe_cfg.moe.num_experts, moe_cfg.moe.top_k
    if E % ep_size:
        raise ConfigError("parallel.ep", f"{E} experts cannot be split over ep={ep_size}",
                          "choose ep dividing model.moe.num_experts")
    state = upcycle_dense_state(dense_state, E // ep_size)
    generator = torch.Generator().manual_seed(seed)
    scale = E / K if preserve_output and not moe_cfg.moe.norm_topk_prob else 1.0
    for i in range(moe_cfg.n_layers):
        prefix = f"blocks.{i}.ffn"
        down = state[f"{prefix}.w_down_EDF"]
        state[f"{prefix}.w_down_EDF"] = down * scale
        router = torch.randn(E, moe_cfg.d_model, generator=generator, dtype=torch.float32) * router_std
        state[f"{prefix}.router.weight"] = router.to(down.dtype)
    return state


def upcycle_checkpoint(dense_ckpt: str | Path, moe_cfg: ModelConfig, out_dir: str | Path, ep_size: int = 1,
                       router_std: float = 0.0, seed: int = 0) -> Path:
    """Dense checkpoint (ckpt-a/b or model-step-N of a kind=dense run) -> model-only MoE checkpoint for a run with
    parallel.ep=ep_size; start the MoE run with model.init_from=ckpt:<out_dir>."""
    dense_state, dense_cfg = full_state_from_checkpoint(dense_ckpt)
    if dense_cfg is None or dense_cfg.kind != "dense":
        raise ConfigError("model.init_from", f"{dense_ckpt} is not a checkpoint of a kind=dense run",
                          "upcycle from a dense run's checkpoints/model-step-N")
    _check_shapes(dense_cfg, moe_cfg)
    full = upcycle_state(dense_state, moe_cfg, 0, 1, router_std, seed)
    return write_model_checkpoint(full, dataclasses.replace(moe_cfg, init_from=None), out_dir, ep_size=ep_size)
