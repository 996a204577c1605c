"""`moe-launch export runs/<name> --hf DIR` and `moe-launch import HF_DIR --out DIR`: whole runs <-> transformers.

Export picks the newest checkpoint of the run that verifies (ckpt-a, ckpt-b or model-step-N; a damaged newer one is
skipped and named), gathers its EP shards (gather.py), writes the OLMoE-format weights and config (hf.py), and puts
the run's tokenizer beside them with its special-token ids, so `AutoTokenizer` / `AutoModelForCausalLM` load the
directory as it is. Every file is written mode 0644: the directory is meant to be shared or uploaded.
Import is the reverse for model weights: a model-only checkpoint that a run starts from with model.init_from=ckpt:DIR.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from moe_launch.conf.load import load_config
from moe_launch.conf.schema import RootConfig
from moe_launch.errors import CheckpointError, ConfigError
from moe_launch.trainer.checkpoint.store import read_manifest, verify

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


def newest_valid_checkpoint(ckpt_root: Path) -> tuple[Path, dict[str, str]]:
    """(the verified checkpoint with the highest step, {rejected name: reason}). Full slots win ties with a
    model-only checkpoint of the same step (same weights; either would do)."""
    found, rejected = [], {}
    for d in sorted(p for p in Path(ckpt_root).glob("*") if p.is_dir() and not p.name.startswith(".")):
        ok, reason = verify(d)
        if not ok:
            rejected[d.name] = reason
            continue
        found.append((int(read_manifest(d)["step"]), not d.name.startswith("model-step-"), d))
    if not found:
        why = "; ".join(f"{k}: {v}" for k, v in rejected.items()) or "none written yet"
        raise CheckpointError(f"no valid checkpoint under {ckpt_root} ({why}); let the run write one "
                              "(train.ckpt_interval / train.model_ckpt_interval)")
    return max(found)[2], rejected


def run_tokenizer(cfg: RootConfig) -> tuple[Path, str]:
    """(tokenizer.json, end-of-document token text) of the run's data: the copy inside its prepared dataset when
    there is one, else data.tokenizer (built-in: the cached byte-level BPE the run was trained with)."""
    from moe_launch.trainer.data.builtin import resolve_dataset
    from moe_launch.trainer.data.tokenizer import load_tokenizer

    d = cfg.data
    if d.format == "npy":
        dataset = resolve_dataset(d, cfg.train.seq_len, cfg.model.vocab_size)
        path = dataset / "tokenizer.json"
        eos = json.loads((dataset / "index.json").read_text())["eos_id"]
    elif d.tokenizer != "builtin":
        from moe_launch.trainer.data.tokenizer import eos_id

        path = Path(d.tokenizer).expanduser()
        eos = eos_id(load_tokenizer(path))
    else:
        raise ConfigError("data.tokenizer", "a Megatron dataset does not record its tokenizer",
                          "set data.tokenizer=/path/to/tokenizer.json in the run's config.yaml")
    return path, load_tokenizer(path).id_to_token(eos)


def _write_tokenizer(out: Path, tokenizer_json: Path, eos_text: str, max_len: int) -> tuple[int, int]:
    """tokenizer.json + tokenizer_config.json; returns the (BOS, EOS) ids. A tokenizer without a BOS token of its
    own (the built-in BPE, GPT-2's) opens sequences with its end-of-text token."""
    from moe_launch.trainer.data.tokenizer import load_tokenizer

    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    tok = load_tokenizer(tokenizer_json)
    bos_text = next((t for t in _BOS_CANDIDATES if tok.token_to_id(t) is not None), eos_text)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos_text, "eos_token": eos_text,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    return tok.token_to_id(bos_text), tok.token_to_id(eos_text)


def export_run(run_dir: str | Path, out_dir: str | Path, checkpoint: Optional[str] = None,
               dtype: Optional[str] = None) -> Path:
    from moe_launch.trainer.interop.gather import full_state_from_checkpoint
    from moe_launch.trainer.interop.hf import export_hf

    run_dir, out = Path(run_dir), Path(out_dir)
    cfg = load_config(run_dir / "config.yaml")
    if checkpoint is not None:
        ckpt = run_dir / "checkpoints" / checkpoint
        ok, reason = verify(ckpt)
        if not ok:
            raise CheckpointError(f"{reason}; pick another with --checkpoint, or omit it for the newest valid one")
    else:
        ckpt, rejected = newest_valid_checkpoint(run_dir / "checkpoints")
        for name, reason in rejected.items():
            print(f"moe-launch: skipped checkpoint {name}: {reason}")
    if "model/dense.pt" not in read_manifest(ckpt)["files"]:
        raise CheckpointError(f"{ckpt} holds stage-sharded files of a pipeline-parallel run; export needs the "
                              "unpipelined layout: write a model checkpoint from a parallel.pp=1 run")
    state, model_cfg = full_state_from_checkpoint(ckpt)
    tok_json, eos_text = run_tokenizer(cfg)  # before writing anything: a run without its tokenizer is refused whole
    export_hf(state, model_cfg or cfg.model, out, dtype=DTYPES.get(dtype) if dtype else None)
    bos, eos = _write_tokenizer(out, tok_json, eos_text, (model_cfg or cfg.model).max_seq_len)
    config = json.loads((out / "config.json").read_text())
    config.update(bos_token_id=bos, eos_token_id=eos)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}, indent=2) + "\n")
    (out / "moe_launch_source.json").write_text(json.dumps(
        {"run": str(run_dir.resolve()), "checkpoint": ckpt.name, "step": read_manifest(ckpt)["step"]}, indent=2) + "\n")
    for f in out.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)
    return out


def import_hf(hf_dir: str | Path, out_dir: str | Path, ep: int = 1) -> Path:
    from moe_launch.trainer.interop.gather import write_model_checkpoint
    from moe_launch.trainer.interop.hf import hf_state_for_rank
    from moe_launch.trainer.interop.hf_config import model_config_from_hf, read_hf_config

    cfg = model_config_from_hf(read_hf_config(hf_dir))
    return write_model_checkpoint(hf_state_for_rank(hf_dir, cfg), cfg, out_dir, ep_size=ep)
