"""The built-in corpus: the Python standard library's own sources (code, comments and docstrings).

Every Python installation carries it, so the demo and the tests train on real text and code with no network access
and no third-party text in this repository. The selection is deterministic for a given Python version: files are
ordered by a hash of their relative path (so a size cap takes an even sample of the library, not just the modules
starting with "a"..."e"), taken until the cap, then written in path order.

Also home to the document readers shared by `moe-data prepare`: one document per line of `.jsonl` (field "text",
optionally gzipped), one document per file for anything else.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from moe_launch.errors import DataError

BUILTIN_CORPUS_BYTES = 8 * 1024 * 1024  # ~8 MB: big enough to train a tiny model, small enough to build in seconds
_MAX_FILE_BYTES = 300 * 1024  # skip generated tables (unicode data and the like)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "__pycache__", "__phello__"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_tag() -> str:
    return f"{sys.implementation.name}{sys.version_info.major}.{sys.version_info.minor}"


def stdlib_files(max_bytes: int = BUILTIN_CORPUS_BYTES) -> list[Path]:
    """The stdlib .py files of the built-in corpus, in path order, at most `max_bytes` in all."""
    root = stdlib_dir()
    candidates: list[tuple[str, Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            size = path.stat().st_size
            if 0 < size <= _MAX_FILE_BYTES:
                rel = path.relative_to(root).as_posix()
                candidates.append((hashlib.sha1(rel.encode()).hexdigest(), path, size))
    if not candidates:
        raise DataError(f"found no standard-library sources under {root}; pass --input with your own text instead")
    chosen, total = [], 0
    for _digest, path, size in sorted(candidates):
        if total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    return sorted(chosen, key=lambda p: p.relative_to(root).as_posix())


def builtin_documents(max_bytes: int = BUILTIN_CORPUS_BYTES) -> Iterator[str]:
    for path in stdlib_files(max_bytes):
        yield path.read_text(encoding="utf-8", errors="replace")


def write_builtin_corpus(out_dir: Path, max_bytes: int = BUILTIN_CORPUS_BYTES, files: int = 8) -> list[Path]:
    """Materialise the built-in corpus as `files` JSON-lines files (so `prepare` can tokenize them in parallel)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = stdlib_files(max_bytes)
    root = stdlib_dir()
    written = []
    per_file = -(-len(paths) // files)
    for i in range(files):
        chunk = paths[i * per_file:(i + 1) * per_file]
        if not chunk:
            break
        target = out_dir / f"stdlib-{i:03d}.jsonl"
        tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            for path in chunk:
                text = path.read_text(encoding="utf-8", errors="replace")
                f.write(json.dumps({"text": text, "source": path.relative_to(root).as_posix()}) + "\n")
        os.replace(tmp, target)
        written.append(target)
    return written


def read_documents(path: Path) -> Iterator[str]:
    """Documents of one input file: a line of .jsonl / .jsonl.gz (field "text") or a whole text file."""
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise DataError(
                        f"{path}:{lineno}: expected a JSON object with a \"text\" field ({exc}); "
                        "fix the file or pass plain-text files instead"
                    ) from exc
                yield text
    else:
        yield path.read_text(encoding="utf-8", errors="replace")
