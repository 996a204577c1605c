"""The built-in dataset and `resolve_dataset`, the trainer's one call to find its data.

`resolve_dataset` returns data.path (validated) when set; otherwise the built-in corpus prepared into data.cache_dir
under a key hashing everything that changes its tokens (vocab, seq_len, seed, tokenizer, corpus size, Python version,
format version). Many ranks may call it at once: one builds under an exclusive file lock while the others wait, the
finished dataset appears by an atomic rename, and later calls return after one stat + index validation.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock

from moe_launch.conf.schema import DataConfig
from moe_launch.errors import DataError
from moe_launch.trainer.data.corpus import BUILTIN_CORPUS_BYTES, python_tag, write_builtin_corpus
from moe_launch.trainer.data.dataset import open_dataset
from moe_launch.trainer.data.prepare import PrepareSpec, prepare
from moe_launch.trainer.data.shards import INDEX_NAME

BUILTIN_DATASET_VERSION = 1


def builtin_key(vocab_size: int, seq_len: int, seed: int, tokenizer: str, corpus_bytes: int) -> str:
    tok = tokenizer
    if tokenizer != "builtin":
        tok = hashlib.sha256(Path(tokenizer).expanduser().read_bytes()).hexdigest()
    fields = {"v": BUILTIN_DATASET_VERSION, "vocab": vocab_size, "seq_len": seq_len, "seed": seed,
              "tokenizer": tok, "corpus_bytes": corpus_bytes, "python": python_tag()}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def prepare_builtin(
    output: str | Path,
    *,
    seq_len: int = 128,
    vocab_size: int = 4096,
    seed: int = 0,
    tokenizer: str = "builtin",
    shard_size: int = 4096,
    workers: int = 2,
    cache_dir: str = "~/.cache/moe-launch/data",
    corpus_bytes: int = BUILTIN_CORPUS_BYTES,
    cluster: str = "local",
    progress: bool = False,
) -> dict[str, Any]:
    """`moe-data prepare --builtin`: write the stdlib corpus as JSON lines next to `output`, then prepare it."""
    output = Path(output).expanduser().resolve()
    corpus_dir = output.with_name(f".{output.name}.corpus")
    if not (output / INDEX_NAME).exists():
        write_builtin_corpus(corpus_dir, corpus_bytes, files=max(8, 2 * workers))
    spec = PrepareSpec(
        inputs=(str(corpus_dir),), output=str(output), tokenizer=tokenizer, seq_len=seq_len, shard_size=shard_size,
        workers=workers, seed=seed, vocab_size=vocab_size, cluster=cluster, cache_dir=cache_dir, progress=progress,
        builtin_corpus_bytes=corpus_bytes,
    )
    summary = prepare(spec)
    shutil.rmtree(corpus_dir, ignore_errors=True)
    return summary


def build_builtin(
    data_cfg: DataConfig,
    seq_len: int,
    vocab_size: int,
    *,
    corpus_bytes: int = BUILTIN_CORPUS_BYTES,
    cluster: str = "local",
    progress: bool = False,
) -> tuple[Path, Optional[dict[str, Any]]]:
    """The built-in dataset's directory in data.cache_dir, built if missing; the summary when this call built it."""
    cache = Path(data_cfg.cache_dir).expanduser()
    key = builtin_key(vocab_size, seq_len, data_cfg.seed, data_cfg.tokenizer, corpus_bytes)
    final = cache / f"builtin-{key}"
    summary = None
    if not (final / INDEX_NAME).exists():
        cache.mkdir(parents=True, exist_ok=True)
        with FileLock(cache / f".builtin-{key}.lock"):
            if not (final / INDEX_NAME).exists():  # another process may have built it while we waited
                # a fixed work dir: a build killed half-way resumes from its completion markers
                work = cache / f".builtin-{key}.work"
                summary = prepare_builtin(
                    work, seq_len=seq_len, vocab_size=vocab_size, seed=data_cfg.seed, tokenizer=data_cfg.tokenizer,
                    shard_size=data_cfg.shard_size, workers=data_cfg.workers, cache_dir=str(cache),
                    corpus_bytes=corpus_bytes, cluster=cluster, progress=progress,
                )
                os.replace(work, final)  # atomic: readers never see a half-written dataset
                summary["output"] = str(final)
    return final, summary


def resolve_dataset(
    data_cfg: DataConfig,
    seq_len: int,
    vocab_size: int,
    *,
    corpus_bytes: int = BUILTIN_CORPUS_BYTES,
    progress: bool = False,
) -> Path:
    """The dataset directory (npy) or prefix (megatron) to hand to TokenLoader, validated for seq_len and vocab."""
    if data_cfg.path:
        path = Path(data_cfg.path).expanduser()
        open_dataset(path, data_cfg.format, seq_len, vocab_size)
        return path
    if data_cfg.format != "npy":
        raise DataError("data.format=megatron needs data.path (the .bin/.idx prefix); set it or use data.format=npy")
    path, _summary = build_builtin(data_cfg, seq_len, vocab_size, corpus_bytes=corpus_bytes, progress=progress)
    open_dataset(path, "npy", seq_len, vocab_size)
    return path
