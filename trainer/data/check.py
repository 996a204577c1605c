"""The launch-time data check: what the trainer would refuse, found before anything is allocated.

    check_data(data_cfg, seq_len, vocab_size, launch_dir, eval_sequences=0) -> the DataConfig to run with (data.path
        and data.eval_path made absolute); eval_sequences > 0: data.eval_path is checked the same way and must hold
        that many sequences (train.eval_batches global batches)

`moe-launch` (and --dry-run) calls it at plan time. It reads only headers: index.json and each shard's .npy header
through a memory map (rows are never read), or a Megatron .idx plus a bounded prefix of the .bin for the token-id
check, so it stays well under a couple of seconds however large the dataset. A relative data.path is resolved
against the directory `moe-launch` was started from: the trainer runs elsewhere (the run directory, other nodes).
Every error names the key of the path it is about.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from moe_launch.conf.schema import DataConfig
from moe_launch.errors import DataError
from moe_launch.trainer.data import megatron, shards

_SCAN_TOKENS = 1 << 24  # Megatron token-id check at launch: the first 16M tokens (the trainer checks more)


def absolute_paths(data: DataConfig, launch_dir: Path) -> DataConfig:
    """Pure: data.path and a tokenizer file given relative to the launch directory, made absolute."""
    def fix(p: str) -> str:
        path = Path(p).expanduser()
        return str(path if path.is_absolute() else launch_dir / path)

    tokenizer = data.tokenizer if data.tokenizer == "builtin" else fix(data.tokenizer)
    return replace(data, path=fix(data.path) if data.path else None, tokenizer=tokenizer,
                   eval_path=fix(data.eval_path) if data.eval_path else None)


def check_data(data: DataConfig, seq_len: int, vocab_size: int, launch_dir: Path,
               eval_sequences: int = 0) -> DataConfig:
    data = absolute_paths(data, launch_dir)
    if data.path is not None:  # the built-in corpus is prepared (and checked) on first use
        _check_one("data.path", data.path, data.format, seq_len, vocab_size)
    if eval_sequences and data.eval_path is not None:
        held = _check_one("data.eval_path", data.eval_path, data.format, seq_len, vocab_size)
        if held < eval_sequences:
            raise DataError(f"data.eval_path={data.eval_path}: {held} sequences of train.seq_len+1, fewer than the "
                            f"{eval_sequences} of train.eval_batches x train.global_batch_size; lower "
                            "train.eval_batches or hold out more data")
    return data


def _check_one(key: str, path: str, fmt: str, seq_len: int, vocab_size: int) -> int:
    """The dataset's instance count; a DataError naming `key` if the trainer would refuse it."""
    try:
        if fmt == "npy":
            return _check_npy(Path(path), seq_len, vocab_size)
        return _check_megatron(Path(path), seq_len, vocab_size)
    except DataError as e:
        text = str(e)
        raise DataError(text if f"{key}=" in text else f"{key}={path}: {text}") from None


def _check_npy(path: Path, seq_len: int, vocab_size: int) -> int:
    index = shards.read_index(path)
    if seq_len > index.seq_len:
        raise DataError(f"train.seq_len={seq_len} is longer than the dataset's instances ({index.seq_len} tokens + 1); "
                        f"lower train.seq_len or re-run `moe-data prepare --seq-len {seq_len}`")
    if index.max_token_id >= vocab_size:
        raise DataError(f"the dataset holds token id {index.max_token_id} but model.vocab_size={vocab_size}; raise "
                        f"model.vocab_size to at least {index.max_token_id + 1} or prepare with a matching tokenizer")
    if index.total_instances == 0:
        raise DataError(f"the dataset holds no instances; {shards.prepare_hint(path)}")
    shards.open_shards(path, index)  # headers only: dtype, [count, seq_len+1], and a file long enough for them
    return index.total_instances


def _check_megatron(prefix: Path, seq_len: int, vocab_size: int) -> int:
    ds = megatron.read_indexed_dataset(prefix)
    total = int(ds.lengths_S.astype(np.int64).sum())
    if total // (seq_len + 1) == 0:
        raise DataError(f"{total} tokens, fewer than one instance of train.seq_len+1={seq_len + 1}; use more data or "
                        "lower train.seq_len")
    head = np.asarray(ds.tokens[:_SCAN_TOKENS])
    if head.size and int(head.max()) >= vocab_size:
        raise DataError(f"the dataset holds token id {int(head.max())} but model.vocab_size={vocab_size}; raise "
                        "model.vocab_size or tokenize with a matching tokenizer")
    if head.size and int(head.min()) < 0:
        raise DataError("the .bin file holds a negative token id; it is corrupt")
    return total // (seq_len + 1)
