"""HF `config.json` <-> our ModelConfig for the OLMoE format (transformers' OlmoeForCausalLM).

Which HF class our decoder matches, exactly:
  * kind=moe: OlmoeForCausalLM. Same block: pre-norm RMSNorm before attention and before the MoE, QK-norm as an
    RMSNorm over the FULL q and k projections (not per head) before RoPE, "rotate half" RoPE, softmax router in fp32
    -> top-k -> optional renormalisation (norm_topk_prob), SwiGLU experts, final RMSNorm, untied head.
  * kind=dense: also OlmoeForCausalLM, with one expert and top-1. The router's softmax over one expert is exactly
    1.0, so that model computes our dense block bit for bit; its single expert holds our dense SwiGLU.
  * Olmo2ForCausalLM / OLMo-2 is NOT our dense model: it applies RMSNorm to the OUTPUT of attention and of the MLP
    (x + norm(attn(x)), "reordered norm") where we normalise the input (x + attn(norm(x))). OLMo-1
    (OlmoForCausalLM) uses a non-parametric LayerNorm and no QK-norm. Loading either into our blocks would compute a
    different function, so both are refused with an error that says so (see `refuse_unsupported`).

Only what is exact is accepted: GQA (num_key_value_heads < num_attention_heads), clip_qkv, attention biases,
RoPE scaling and activations other than SiLU have no counterpart in our model and are refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional

from moe_launch.conf.schema import ModelConfig
from moe_launch.errors import ConfigError

# Extra key we write into config.json so a round trip restores kind=dense (transformers ignores unknown keys).
KIND_KEY = "moe_launch_kind"


def read_hf_config(path: str | Path) -> dict[str, Any]:
    path = Path(str(path).removeprefix("hf:")).expanduser()
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError("model.init_from", f"{cfg_file} does not exist",
                          "point hf:/path at a directory holding config.json and *.safetensors (save_pretrained)")
    return json.loads(cfg_file.read_text())


def rope_theta_of(hf: dict[str, Any]) -> float:
    """transformers 5 nests RoPE settings in rope_parameters; 4.x config.json files keep rope_theta at the top."""
    params = hf.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf.get("rope_theta", 10000.0))


def refuse_unsupported(hf: dict[str, Any]) -> None:
    """Raise ConfigError for any HF setting our decoder cannot reproduce exactly."""
    kind = hf.get("model_type")
    if kind in ("olmo2", "olmo3"):
        raise ConfigError("model.init_from", f"model_type={kind!r} normalises the outputs of attention and MLP "
                          "(post-norm), our blocks normalise their inputs (pre-norm); the logits would differ",
                          "import an OLMoE-format checkpoint (model_type=olmoe), or add a post-norm block option "
                          "to trainer/model first")
    if kind == "olmo":
        raise ConfigError("model.init_from", "model_type='olmo' (OLMo-1) uses a non-parametric LayerNorm and no "
                          "QK-norm; our blocks use RMSNorm with weights and QK-norm",
                          "import an OLMoE-format checkpoint (model_type=olmoe)")
    if kind != "olmoe":
        raise ConfigError("model.init_from", f"model_type={kind!r} is not supported",
                          "use an OlmoeForCausalLM checkpoint (allenai/OLMoE-1B-7B-0924 format)")
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    checks = [
        (kv == heads, f"num_key_value_heads={kv} < num_attention_heads={heads} (GQA)"),
        (hf.get("clip_qkv") is None, f"clip_qkv={hf.get('clip_qkv')}"),
        (not hf.get("attention_bias", False), "attention_bias=true"),
        (hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')!r}"),
        ((hf.get("rope_parameters") or {}).get("rope_type", "default") == "default" and not hf.get("rope_scaling"),
         "RoPE scaling"),
        (hf.get("head_dim") in (None, hf["hidden_size"] // heads), f"head_dim={hf.get('head_dim')}"),
    ]
    for ok, what in checks:
        if not ok:
            raise ConfigError("model.init_from", f"the HF model uses {what}, which our decoder does not implement",
                              "import a checkpoint without it (our attention is plain multi-head, SiLU, no bias)")


def model_config_from_hf(hf: dict[str, Any], base: Optional[ModelConfig] = None) -> ModelConfig:
    """The ModelConfig that reproduces an OLMoE config.json. Training-only fields (loss coefficients, impl,
    dispatcher, init_std, name) come from `base` (defaults if None)."""
    refuse_unsupported(hf)
    base = base or ModelConfig()
    dense = hf.get(KIND_KEY) == "dense" and hf["num_experts"] == 1
    moe = dataclasses.replace(base.moe, num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                              expert_hidden=hf["intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob")))
    return dataclasses.replace(
        base, kind="dense" if dense else "moe", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        ffn_hidden=hf["intermediate_size"] if dense else base.ffn_hidden,
        max_seq_len=hf.get("max_position_embeddings", base.max_seq_len), rope_theta=rope_theta_of(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)), qk_norm=True, moe=moe if not dense else base.moe,
        init_from=None,
    )


def check_compatible(hf: dict[str, Any], cfg: ModelConfig) -> None:
    """Raise ConfigError naming the first model.* key whose value differs from the HF checkpoint's."""
    refuse_unsupported(hf)
    want = model_config_from_hf(hf, cfg)
    if cfg.kind == "dense":
        if hf["num_experts"] != 1 or hf["num_experts_per_tok"] != 1:
            raise ConfigError("model.kind", f"dense, but the checkpoint has {hf['num_experts']} experts "
                              f"(top-{hf['num_experts_per_tok']})",
                              "use model.kind=moe with matching model.moe.*, or import a 1-expert top-1 checkpoint")
        pairs = [("model.ffn_hidden", cfg.ffn_hidden, hf["intermediate_size"])]
    else:
        pairs = [("model.moe.num_experts", cfg.moe.num_experts, want.moe.num_experts),
                 ("model.moe.top_k", cfg.moe.top_k, want.moe.top_k),
                 ("model.moe.expert_hidden", cfg.moe.expert_hidden, want.moe.expert_hidden),
                 ("model.moe.norm_topk_prob", cfg.moe.norm_topk_prob, want.moe.norm_topk_prob)]
    pairs += [(f"model.{k}", getattr(cfg, k), getattr(want, k))
              for k in ("vocab_size", "d_model", "n_layers", "n_heads", "rope_theta", "norm_eps", "qk_norm")]
    for key, ours, theirs in pairs:
        same = math.isclose(ours, theirs, rel_tol=1e-9) if isinstance(ours, float) else ours == theirs
        if not same:
            raise ConfigError(key, f"is {ours!r} but the HF checkpoint has {theirs!r}",
                              f"set {key}={theirs} (model_config_from_hf derives the whole model.* group)")


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for OlmoeForCausalLM (readable by transformers 4.x and 5.x)."""
    if not cfg.qk_norm:
        raise ConfigError("model.qk_norm", "is false, but the OLMoE format always applies QK-norm",
                          "export only models trained with model.qk_norm=true")
    dense = cfg.kind == "dense"
    return {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        KIND_KEY: cfg.kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden if dense else cfg.moe.expert_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "num_experts": 1 if dense else cfg.moe.num_experts,
        "num_experts_per_tok": 1 if dense else cfg.moe.top_k,
        "norm_topk_prob": False if dense else cfg.moe.norm_topk_prob,
        "router_aux_loss_coef": 0.0 if dense else cfg.moe.aux_loss_coef,
        "output_router_logits": False,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # 4.x reads this key
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},  # 5.x reads this one
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }
