"""The prepared-dataset format: `shard-00000.npy` files of shape [n, seq_len+1] plus `index.json`.

index.json (written last, atomically: its presence means the dataset is complete):
    format, version, seq_len, dtype ("uint16" when vocab_size < 65536 else "uint32"), vocab_size, eos_id,
    max_token_id, shards [{file, count}], total_instances, total_tokens, tokenizer, seed, shard_size, source {...}
Every shard holds `shard_size` instances except possibly the last. Rows are already shuffled across all input files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moe_launch.errors import DataError

INDEX_NAME = "index.json"
FORMAT = "moe-launch-shards"
VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size < 65536 else np.uint32)


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.npy"


def prepare_hint(path: Path | str) -> str:
    return (
        f"run `moe-data prepare --input YOUR_TEXT --output {path} --seq-len L` (or `moe-data prepare --builtin "
        f"--output {path}`), or leave data.path unset to use the built-in corpus"
    )


@dataclass
class ShardIndex:
    seq_len: int
    dtype: str
    vocab_size: int
    eos_id: int
    max_token_id: int
    shards: list[dict[str, Any]]
    tokenizer: str
    seed: int
    shard_size: int
    total_tokens: int = 0
    source: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    @property
    def total_instances(self) -> int:
        return sum(int(s["count"]) for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["total_instances"] = self.total_instances
        return out


def write_shard(out_dir: Path, i: int, rows_NL: np.ndarray) -> Path:
    """Write one shard atomically (temp file + rename), so a killed writer never leaves a short shard behind."""
    target = out_dir / shard_name(i)
    tmp = out_dir / f".{target.name}.tmp.{os.getpid()}.npy"
    np.save(tmp, np.ascontiguousarray(rows_NL))
    os.replace(tmp, target)
    return target


def write_index(out_dir: Path, index: ShardIndex) -> Path:
    target = out_dir / INDEX_NAME
    tmp = out_dir / f".{INDEX_NAME}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(index.to_json(), f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


def read_index(path: Path | str) -> ShardIndex:
    path = Path(path).expanduser()
    index_file = path / INDEX_NAME
    if not path.exists():
        raise DataError(f"data.path={path} does not exist; {prepare_hint(path)}")
    if not index_file.is_file():
        raise DataError(
            f"data.path={path} has no {INDEX_NAME} (not a prepared dataset, or `moe-data prepare` did not finish); "
            f"{prepare_hint(path)}"
        )
    try:
        raw = json.loads(index_file.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{index_file} is not valid JSON ({exc}); re-run `moe-data prepare` into a fresh directory"
        ) from exc
    if raw.get("format") != FORMAT:
        raise DataError(f"{index_file} is not a {FORMAT} index (format={raw.get('format')!r}); {prepare_hint(path)}")
    raw.pop("total_instances", None)
    known = set(ShardIndex.__dataclass_fields__)
    try:
        return ShardIndex(**{k: v for k, v in raw.items() if k in known})
    except TypeError as exc:
        raise DataError(f"{index_file} lacks fields ({exc}); re-run `moe-data prepare` into a fresh directory") from exc


def open_shards(path: Path | str, index: ShardIndex) -> list[np.ndarray]:
    """Memory-map every shard and check it against the index (dtype, row length, row count)."""
    path = Path(path).expanduser()
    shards = []
    for entry in index.shards:
        file = path / entry["file"]
        if not file.is_file():
            raise DataError(f"shard {file} listed in {path / INDEX_NAME} is missing; re-run `moe-data prepare`")
        try:
            arr = np.load(file, mmap_mode="r")
        except ValueError as exc:
            raise DataError(f"shard {file} is not a readable .npy file ({exc}); re-run `moe-data prepare`") from exc
        expected = (int(entry["count"]), index.seq_len + 1)
        if arr.dtype != np.dtype(index.dtype):
            raise DataError(
                f"shard {file} has dtype {arr.dtype}, but {INDEX_NAME} says {index.dtype}; the shard does not "
                "belong to this dataset: re-run `moe-data prepare` into a fresh directory"
            )
        if arr.shape != expected:
            raise DataError(
                f"shard {file} has shape {tuple(arr.shape)}, but {INDEX_NAME} says {expected} "
                f"([count, seq_len+1]); re-run `moe-data prepare` into a fresh directory"
            )
        shards.append(arr)
    return shards
