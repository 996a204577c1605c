"""`moe-launch export runs/<name> --hf DIR` on a real trained run: newest valid checkpoint, tokenizer and special
ids, 0644 files; transformers' Auto classes load it and generate; `moe-launch import` round-trips the weights."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_harness import tiny_cfg, write_run  # noqa: E402

from moe_launch.rundir import EXIT_OK  # noqa: E402
from moe_launch.trainer.interop.gather import full_state_from_checkpoint  # noqa: E402
from moe_launch.trainer.loop import Trainer  # noqa: E402

MOE_LAUNCH = str(Path(sys.executable).with_name("moe-launch"))
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    cfg = tiny_cfg(str(root / "data-cache"), steps=4, ckpt_interval=2, tracking=[])
    rd = write_run(root / "runs" / "tiny", cfg)
    assert Trainer(cfg, rd).train() == EXIT_OK
    return rd


def _export(run, out, *extra):
    return subprocess.run([MOE_LAUNCH, "export", str(run), "--hf", str(out), *extra], capture_output=True, text=True,
                          timeout=120)


def test_export_loads_in_transformers_and_generates(trained_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    proc = _export(trained_run.root, out)
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in out.iterdir()}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())
    assert json.loads((out / "moe_launch_source.json").read_text())["step"] == 4  # ckpt-b, the newest
    config = json.loads((out / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert config["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert config["bos_token_id"] == tok.bos_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "OlmoeForCausalLM"
    ids = tok("def main(", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 6) and torch.equal(gen[:, : ids.shape[1]], ids)
    assert isinstance(tok.decode(gen[0]), str)


def test_a_damaged_newest_checkpoint_is_skipped_and_named(trained_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run.root, run)
    weights = run / "checkpoints" / "ckpt-b" / "model" / "dense.pt"
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated: fails verification
    proc = _export(run, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "skipped checkpoint ckpt-b" in proc.stdout
    assert json.loads((tmp_path / "hf" / "moe_launch_source.json").read_text())["step"] == 2


def test_import_round_trips_the_weights(trained_run, tmp_path):
    assert _export(trained_run.root, tmp_path / "hf").returncode == 0
    proc = subprocess.run([MOE_LAUNCH, "import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    back, _ = full_state_from_checkpoint(tmp_path / "ckpt")
    orig, _ = full_state_from_checkpoint(trained_run.checkpoints / "ckpt-b")
    assert back.keys() == orig.keys()
    assert all(torch.equal(back[k], orig[k]) for k in orig)


def test_run_without_checkpoints_is_refused(tmp_path, trained_run):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run.root, run)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    proc = _export(run, tmp_path / "hf")
    assert proc.returncode == 2 and "no valid checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "hf").exists()


def test_a_tokenizer_with_its_own_bos_keeps_it(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from moe_launch.trainer.interop.run_export import _write_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                                      show_progress=False))
    tok.save(str(tmp_path / "tok.json"))
    out = tmp_path / "hf"
    out.mkdir()
    assert _write_tokenizer(out, tmp_path / "tok.json", "</s>", 64) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))
    assert json.loads((out / "tokenizer_config.json").read_text())["bos_token"] == "<s>"
