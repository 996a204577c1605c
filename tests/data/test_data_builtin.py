"""The built-in corpus and resolve_dataset: deterministic corpus, cached dataset, safe under concurrent callers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from data_helpers import TINY_VOCAB

from moe_launch.conf.schema import DataConfig
from moe_launch.errors import DataError
from moe_launch.trainer.data.builtin import builtin_key, resolve_dataset
from moe_launch.trainer.data.corpus import read_documents, stdlib_files, write_builtin_corpus
from moe_launch.trainer.data.loader import TokenLoader
from moe_launch.trainer.data.shards import read_index

SMALL = 200_000  # bytes of stdlib text: enough for a few hundred instances, tokenizer trained in well under a second


def test_corpus_is_deterministic_and_capped(tmp_path):
    files = stdlib_files(SMALL)
    assert files == stdlib_files(SMALL) and files == sorted(files)
    total = sum(f.stat().st_size for f in files)
    assert SMALL * 0.8 < total <= SMALL
    assert not any("/test/" in str(f) or "/site-packages/" in str(f) for f in files)
    # spread over the library, not the alphabetically first modules
    assert len({f.parent.name for f in files}) > 1 or len(files) > 5
    written = write_builtin_corpus(tmp_path / "c", SMALL, files=4)
    docs = [d for path in written for d in read_documents(path)]
    assert len(docs) == len(files) and docs[0] == files[0].read_text(encoding="utf-8", errors="replace")


_RESOLVE = textwrap.dedent("""
    import sys
    from moe_launch.conf.schema import DataConfig
    from moe_launch.trainer.data.builtin import resolve_dataset
    cfg = DataConfig(cache_dir=sys.argv[1], workers=1, shard_size=64)
    print(resolve_dataset(cfg, 32, %d, corpus_bytes=%d))
""" % (TINY_VOCAB, SMALL))


def test_concurrent_resolve_builds_once(tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", _RESOLVE, str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    path = paths.pop()
    built = [p.name for p in cache.iterdir() if p.name.startswith(("builtin-", ".builtin-")) and p.is_dir()]
    assert built == [path.rsplit("/", 1)[1]]  # one dataset, no work directory left behind
    index = read_index(path)
    assert index.seq_len == 32 and index.vocab_size == TINY_VOCAB and index.total_instances > 100
    # cached: a second call in this process returns the same directory without rebuilding
    cfg = DataConfig(cache_dir=str(cache), workers=1, shard_size=64)
    assert str(resolve_dataset(cfg, 32, TINY_VOCAB, corpus_bytes=SMALL)) == path
    loader = TokenLoader(path, "npy", 32, 4, seed=0, vocab_size=TINY_VOCAB)
    text = json.dumps(loader.get(0).tolist())
    assert text  # readable batch of int ids


def test_resolve_with_data_path(small_dataset, tmp_path):
    cfg = DataConfig(path=str(small_dataset))
    assert resolve_dataset(cfg, 32, TINY_VOCAB) == small_dataset
    with pytest.raises(DataError, match=r"train\.seq_len=200"):
        resolve_dataset(cfg, 200, TINY_VOCAB)
    with pytest.raises(DataError, match=r"data\.path=.*does not exist.*moe-data prepare"):
        resolve_dataset(DataConfig(path=str(tmp_path / "nope")), 32, TINY_VOCAB)
    with pytest.raises(DataError, match="data.format=megatron needs data.path"):
        resolve_dataset(DataConfig(format="megatron"), 32, TINY_VOCAB)


def test_key_covers_what_changes_the_tokens():
    base = builtin_key(4096, 128, 0, "builtin", SMALL)
    assert base == builtin_key(4096, 128, 0, "builtin", SMALL)
    assert len({base, builtin_key(4096, 256, 0, "builtin", SMALL), builtin_key(512, 128, 0, "builtin", SMALL),
                builtin_key(4096, 128, 1, "builtin", SMALL), builtin_key(4096, 128, 0, "builtin", SMALL + 1)}) == 5
