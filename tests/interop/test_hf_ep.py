"""Import and export under expert parallelism (real gloo process groups, DP x EP = 2 x 2).

Each EP rank reads only its experts and, through the trainer's EP dispatcher, computes transformers' logits; the
checkpoint those ranks write (EP-sharded files, DP-scattered) exports back to a model transformers reads.
"""

from __future__ import annotations

import torch
from ep_workers import import_forward_save, spawn
from hf_helpers import rel_err, tiny_olmoe

from moe_launch.trainer.interop.gather import full_state_from_checkpoint, write_model_checkpoint
from moe_launch.trainer.interop.hf import export_hf, hf_state_for_rank
from moe_launch.trainer.interop.hf_config import model_config_from_hf, read_hf_config
from moe_launch.trainer.model import build_model

TOL = 1e-5


def test_ep_import_checkpoint_export(tmp_path):
    from transformers import OlmoeForCausalLM

    torch.set_num_threads(1)
    hf_model = tiny_olmoe(num_experts=4, top_k=2, n_layers=2)
    hf_model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf_model(tokens).logits

    results = spawn(import_forward_save, 4, str(tmp_path / "hf"), str(tmp_path / "ckpt"), 2, 2, tokens)
    for r in results:
        assert r["e_local"] == 2
        assert rel_err(r["logits"], want) <= TOL

    cfg = model_config_from_hf(read_hf_config(tmp_path / "hf"))
    single = hf_state_for_rank(tmp_path / "hf", cfg)
    state, saved_cfg = full_state_from_checkpoint(tmp_path / "ckpt")
    assert saved_cfg == cfg
    assert state.keys() == single.keys() == results[0]["full"].keys()
    for k in single:
        assert torch.equal(state[k], single[k]), k
        assert torch.equal(results[3]["full"][k], single[k]), k

    export_hf(state, saved_cfg, tmp_path / "out")
    back = OlmoeForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(back(tokens).logits, want) <= TOL


def test_converted_checkpoint_reshards_for_another_ep(tmp_path):
    """HF -> model-only checkpoint for ep=4 -> back to the full state, bit for bit; each file holds one expert."""
    torch.set_num_threads(1)
    tiny_olmoe(num_experts=4, n_layers=1).save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(read_hf_config(tmp_path / "hf"))
    full = hf_state_for_rank(tmp_path / "hf", cfg)
    write_model_checkpoint(full, cfg, tmp_path / "model-step-0", ep_size=4)
    assert sorted(p.name for p in (tmp_path / "model-step-0" / "model").iterdir()) == \
        ["dense.pt"] + [f"experts-ep{e}.pt" for e in range(4)]
    state, saved_cfg = full_state_from_checkpoint(tmp_path / "model-step-0")
    assert saved_cfg == cfg and all(torch.equal(state[k], full[k]) for k in full)
    model = build_model(cfg)
    model.load_state_dict(state, strict=True)
