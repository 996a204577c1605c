"""Logit parity with transformers' OlmoeForCausalLM, both directions, fp32 (<= 1e-5 relative)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import rel_err, tiny_olmoe

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.errors import ConfigError
from moe_launch.trainer.interop.hf import export_hf, load_hf_into_model
from moe_launch.trainer.interop.hf_config import model_config_from_hf, read_hf_config
from moe_launch.trainer.model import build_model

TOL = 1e-5


def _tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_experts,top_k,norm_topk", [(4, 2, False), (4, 2, True), (8, 1, False)])
def test_import_matches_transformers(tmp_path, num_experts, top_k, norm_topk):
    torch.set_num_threads(1)
    hf_model = tiny_olmoe(num_experts, top_k, norm_topk)
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(read_hf_config(tmp_path / "hf"))
    assert (cfg.kind, cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.norm_topk_prob) == ("moe", num_experts, top_k,
                                                                                        norm_topk)
    ours = build_model(cfg).eval()
    load_hf_into_model(ours, f"hf:{tmp_path / 'hf'}", ep_rank=0, ep_size=1)
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        assert rel_err(ours(tokens), hf_model(tokens).logits) <= TOL


def test_export_reloads_in_transformers(tmp_path):
    from transformers import OlmoeForCausalLM

    torch.set_num_threads(1)
    cfg = ModelConfig(kind="moe", vocab_size=80, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                      rope_theta=20000.0, norm_eps=1e-6,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, norm_topk_prob=False))
    torch.manual_seed(3)
    ours = build_model(cfg).eval()
    with torch.no_grad():  # non-trivial norms and a decisive router, so every mapping error shows in the logits
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
    export_hf(ours.state_dict(), cfg, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "olmoe"
    hf_model = OlmoeForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = _tokens(cfg.vocab_size, seed=5)
    with torch.no_grad():
        assert rel_err(hf_model(tokens).logits, ours(tokens)) <= TOL


def test_sharded_export_and_tied_import(tmp_path):
    """A multi-file export (index.json) round-trips; a tied-embedding HF model imports with the head = embedding."""
    from transformers import OlmoeForCausalLM

    torch.set_num_threads(1)
    hf_model = tiny_olmoe(tie=True, n_layers=1)
    hf_model.save_pretrained(tmp_path / "tied")
    cfg = model_config_from_hf(read_hf_config(tmp_path / "tied"))
    ours = build_model(cfg).eval()
    load_hf_into_model(ours, tmp_path / "tied")
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        assert rel_err(ours(tokens), hf_model(tokens).logits) <= TOL
    export_hf(ours.state_dict(), cfg, tmp_path / "sharded", max_shard_bytes=8 << 10)
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    back = OlmoeForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(back(tokens).logits, ours(tokens)) <= TOL


def test_dense_round_trip_as_one_expert_olmoe(tmp_path):
    """Our dense model is exported as the 1-expert top-1 OLMoE, which transformers evaluates to the same logits,
    and imports back into a dense model."""
    from transformers import OlmoeForCausalLM

    torch.set_num_threads(1)
    cfg = ModelConfig(kind="dense", vocab_size=64, d_model=32, n_layers=2, n_heads=2, ffn_hidden=40, max_seq_len=32)
    torch.manual_seed(4)
    dense = build_model(cfg).eval()
    export_hf(dense.state_dict(), cfg, tmp_path / "dense")
    hf_model = OlmoeForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        want = dense(tokens)
        assert rel_err(hf_model(tokens).logits, want) <= TOL
    back_cfg = model_config_from_hf(read_hf_config(tmp_path / "dense"))
    assert back_cfg.kind == "dense" and back_cfg.ffn_hidden == 40
    back = build_model(back_cfg).eval()
    load_hf_into_model(back, tmp_path / "dense")
    with torch.no_grad():
        assert torch.equal(back(tokens), want)


def test_mismatch_names_the_key(tmp_path):
    tiny_olmoe(n_layers=1).save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(read_hf_config(tmp_path / "hf"))
    wrong = ModelConfig(**{**cfg.__dict__, "moe": MoEConfig(**{**cfg.moe.__dict__, "top_k": 1})})
    with pytest.raises(ConfigError, match="model.moe.top_k"):
        load_hf_into_model(build_model(wrong), tmp_path / "hf")


def test_olmo2_is_refused_with_the_reason(tmp_path):
    from transformers import Olmo2Config, Olmo2ForCausalLM

    Olmo2ForCausalLM(Olmo2Config(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, pad_token_id=None, eos_token_id=None, bos_token_id=None)
                     ).save_pretrained(tmp_path / "olmo2")
    with pytest.raises(ConfigError, match="post-norm"):
        model_config_from_hf(read_hf_config(tmp_path / "olmo2"))


def test_import_of_the_fused_transformers5_layout(tmp_path):
    """Files holding transformers-5's in-memory tensors (experts.gate_up_proj [E, 2F, D], experts.down_proj
    [E, D, F]) import to the same logits, also sliced for EP."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    hf_model = tiny_olmoe(num_experts=4, top_k=2)
    sd = hf_model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "fused" / "model.safetensors"))
    hf_model.config.to_json_file(str(tmp_path / "fused" / "config.json"))
    cfg = model_config_from_hf(read_hf_config(tmp_path / "fused"))
    ours = build_model(cfg).eval()
    load_hf_into_model(ours, tmp_path / "fused")
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        assert rel_err(ours(tokens), hf_model(tokens).logits) <= TOL
    from moe_launch.trainer.interop.hf import hf_state_for_rank

    upper = hf_state_for_rank(tmp_path / "fused", cfg, ep_rank=1, ep_size=2)
    assert torch.equal(upper["blocks.1.ffn.w_up_EFD"], ours.blocks[1].ffn.w_up_EFD[2:])
