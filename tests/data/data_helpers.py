"""Helpers of the data tests (a uniquely named module: `conftest` is ambiguous across test folders)."""

from __future__ import annotations

import shutil
from pathlib import Path

from moe_launch.trainer.data.corpus import stdlib_dir
from moe_launch.trainer.data.prepare import PrepareSpec

SMALL_MODULES = ("json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py", "textwrap.py", "bisect.py",
                 "colorsys.py", "keyword.py")
TINY_VOCAB = 320


def copy_small_corpus(target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for rel in SMALL_MODULES:
        shutil.copy(stdlib_dir() / rel, target / rel.replace("/", "_"))
    return target


def small_spec(corpus: Path, tokenizer: Path, output: Path, **overrides) -> PrepareSpec:
    base = dict(inputs=(str(corpus),), output=str(output), tokenizer=str(tokenizer), seq_len=32, shard_size=50,
                workers=1, parts=4, seed=3, progress=False)
    base.update(overrides)
    return PrepareSpec(**base)
