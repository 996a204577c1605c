"""The conversion CLI end to end: HF -> our checkpoint (ep=2) -> HF, logits unchanged; dense -> upcycled MoE."""

from __future__ import annotations

import torch
from hf_helpers import rel_err, tiny_olmoe

from moe_launch.trainer.interop.__main__ import main
from moe_launch.trainer.interop.gather import full_state_from_checkpoint


def test_import_then_export_round_trip(tmp_path, capsys):
    from transformers import OlmoeForCausalLM

    torch.set_num_threads(1)
    hf_model = tiny_olmoe(n_layers=1)
    hf_model.save_pretrained(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "model-step-0"), "--ep", "2"]) == 0
    assert (tmp_path / "model-step-0" / "model" / "experts-ep1.pt").is_file()
    assert main(["export", str(tmp_path / "model-step-0"), str(tmp_path / "out")]) == 0
    back = OlmoeForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(back(tokens).logits, hf_model(tokens).logits) <= 1e-6


def test_upcycle_refuses_an_moe_checkpoint(tmp_path, capsys):
    tiny_olmoe(n_layers=1).save_pretrained(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert main(["upcycle", str(tmp_path / "ckpt"), str(tmp_path / "up"), "--experts", "4", "--top-k", "1"]) == 2
    assert "kind=dense" in capsys.readouterr().err
    state, _ = full_state_from_checkpoint(tmp_path / "ckpt")
    assert state["blocks.0.ffn.w_up_EFD"].shape[0] == 4


def test_export_casts_to_bf16(tmp_path):
    import json

    from safetensors import safe_open

    tiny_olmoe(n_layers=1).save_pretrained(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
