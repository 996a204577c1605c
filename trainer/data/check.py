"""The launch-time data check: what the trainer would refuse, found before anything is allocated.

    check_data(data_cfg, seq_len, vocab_size, launch_dir) -> the DataConfig to run with (data.path made absolute)

`moe-launch` (and --dry-run) calls it at plan time. It reads only headers: index.json and each shard's .npy header
through a memory map (rows are never read), or a Megatron .idx plus a bounded prefix of the .bin for the token-id
check, so it stays well under a couple of seconds however large the dataset. A relative data.path is resolved
against the directory `moe-launch` was started from: the trainer runs elsewhere (the run directory, other nodes).
Every error names data.path.
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
    return replace(data, path=fix(data.path) if data.path else None, tokenizer=tokenizer)


def check_data(data: DataConfig, seq_len: int, vocab_size: int, launch_dir: Path) -> DataConfig:
    data = absolute_paths(data, launch_dir)
    if data.path is None:  # the built-in corpus is prepared (and checked) on first use
        return data
    try:
        if data.format == "npy":
            _check_npy(Path(data.path), seq_len, vocab_size)
        else:
            _check_megatron(Path(data.path), seq_len, vocab_size)
    except DataError as e:
        text = str(e)
        raise DataError(text if "data.path=" in text else f"data.path={data.path}: {text}") from None
    return data


def _check_npy(path: Path, seq_len: int, vocab_size: int) -> None:
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


def _check_megatron(prefix: Path, seq_len: int, vocab_size: int) -> None:
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
