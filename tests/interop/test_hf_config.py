"""config.json <-> ModelConfig: the OLMoE-1B-7B shape, refusals, round trip."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.errors import ConfigError
from moe_launch.trainer.interop.hf_config import hf_config_from_model, model_config_from_hf, refuse_unsupported
from moe_launch.trainer.model.transformer import Transformer
from moe_launch.trainer.tracking.flops import active_matmul_params

# The fields of allenai/OLMoE-1B-7B-0924's config.json (transformers-4 style: rope_theta at the top level).
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False, "attention_dropout": 0.0,
    "clip_qkv": None, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024,
    "max_position_embeddings": 4096, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 50304,
}


def test_olmoe_1b_7b_maps_to_a_7b_model_with_1b_active():
    cfg = model_config_from_hf(OLMOE_1B_7B)
    assert (cfg.kind, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.vocab_size, cfg.max_seq_len) == \
        ("moe", 2048, 16, 16, 50304, 4096)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_hidden, cfg.moe.norm_topk_prob) == (64, 8, 1024, False)
    with torch.device("meta"):
        total = sum(p.numel() for p in Transformer(cfg).parameters())
    assert 6.90e9 < total < 6.95e9  # "OLMoE-1B-7B: 6.9B parameters"
    active = active_matmul_params(cfg) + cfg.vocab_size * cfg.d_model  # + the embedding lookup table
    assert 1.2e9 < active < 1.35e9  # "1B (1.3B) active per token"


@pytest.mark.parametrize("change,match", [
    ({"num_key_value_heads": 4}, "GQA"), ({"clip_qkv": 8.0}, "clip_qkv"), ({"attention_bias": True}, "bias"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling"), ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "olmo"}, "OLMo-1"), ({"model_type": "mixtral"}, "not supported"),
])
def test_unsupported_settings_are_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        refuse_unsupported({**OLMOE_1B_7B, **change})


@pytest.mark.parametrize("cfg", [
    ModelConfig(kind="moe", rope_theta=5e5, norm_eps=1e-6, moe=MoEConfig(num_experts=16, top_k=4, expert_hidden=64,
                                                                       norm_topk_prob=True)),
    ModelConfig(kind="dense", ffn_hidden=300),
])
def test_round_trip(cfg):
    back = model_config_from_hf(hf_config_from_model(cfg), base=cfg)
    assert back == dataclasses.replace(cfg, init_from=None)


def test_qk_norm_off_cannot_be_exported():
    with pytest.raises(ConfigError, match="model.qk_norm"):
        hf_config_from_model(ModelConfig(qk_norm=False))
