"""Megatron IndexedDataset (.bin/.idx): byte layout, reader, loader over the concatenated stream, bad files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from moe_launch.errors import DataError
from moe_launch.trainer.data.loader import TokenLoader
from moe_launch.trainer.data.megatron import concatenated_tokens, read_indexed_dataset, write_indexed_dataset
from moe_launch.trainer.data.permutation import permute


def _docs(seed=0, n=30, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(5, 60))) for _ in range(n)]


def test_written_bytes_follow_the_format(tmp_path):
    docs = _docs()
    write_indexed_dataset(tmp_path / "ds", docs, dtype=np.uint16)
    raw = (tmp_path / "ds.idx").read_bytes()
    magic, version, code, n_seq, n_doc = struct.unpack("<9sQBQQ", raw[:34])
    assert (magic, version, code, n_seq, n_doc) == (b"MMIDIDX\x00\x00", 1, 8, 30, 31)
    lengths = np.frombuffer(raw, np.int32, 30, 34)
    pointers = np.frombuffer(raw, np.int64, 30, 34 + 120)
    doc_idx = np.frombuffer(raw, np.int64, 31, 34 + 120 + 240)
    assert len(raw) == 34 + 120 + 240 + 248
    assert lengths.tolist() == [d.size for d in docs]
    assert pointers.tolist() == [2 * sum(d.size for d in docs[:i]) for i in range(30)]
    assert doc_idx.tolist() == list(range(31))
    assert np.array_equal(np.fromfile(tmp_path / "ds.bin", np.uint16), np.concatenate(docs))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reader_round_trip(tmp_path, dtype):
    docs = _docs(1)
    write_indexed_dataset(tmp_path / "ds", docs, dtype=dtype)
    ds = read_indexed_dataset(str(tmp_path / "ds") + ".bin")  # a suffix is tolerated
    assert ds.dtype == np.dtype(dtype) and ds.num_sequences == 30 and ds.num_documents == 30
    assert all(np.array_equal(ds.sequence(i), d) for i, d in enumerate(docs))
    assert np.array_equal(concatenated_tokens(ds), np.concatenate(docs))


def test_loader_over_megatron_stream(tmp_path):
    docs = _docs(2, n=80)
    write_indexed_dataset(tmp_path / "ds", docs)
    stream = np.concatenate(docs)
    seq_len = 15
    n = stream.size // 16
    instances = stream[: n * 16].reshape(n, 16)
    loader = TokenLoader(tmp_path / "ds", "megatron", seq_len, global_batch=4, data_rank=0, data_size=1, seed=5,
                         vocab_size=1000)
    assert loader.n_instances == n
    # stored in document order, so even the first epoch is a seeded permutation
    order = permute(np.arange(n), n, (5, 0))
    assert np.array_equal(loader.get(2).numpy(), instances[order[8:12]])
    halves = [TokenLoader(tmp_path / "ds", "megatron", seq_len, 4, r, 2, seed=5).get(n // 4 + 1) for r in (0, 1)]
    assert torch.equal(torch.cat(halves), loader.get(n // 4 + 1))


def test_bad_megatron_files(tmp_path):
    with pytest.raises(DataError, match=r"data\.path=.*\.idx is missing"):
        TokenLoader(tmp_path / "absent", "megatron", 8, 2)
    write_indexed_dataset(tmp_path / "ds", _docs(3))
    raw = bytearray((tmp_path / "ds.idx").read_bytes())
    (tmp_path / "ds.idx").write_bytes(b"NOTMAGIC!" + bytes(raw[9:]))
    with pytest.raises(DataError, match="bad magic"):
        read_indexed_dataset(tmp_path / "ds")
    (tmp_path / "ds.idx").write_bytes(bytes(raw[:60]))
    with pytest.raises(DataError, match="header promises"):
        read_indexed_dataset(tmp_path / "ds")
    (tmp_path / "ds.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"model\.vocab_size=500"):
        TokenLoader(tmp_path / "ds", "megatron", 8, 2, vocab_size=500)
    with pytest.raises(DataError, match=r"fewer than one instance of train\.seq_len"):
        TokenLoader(tmp_path / "ds", "megatron", 10**6, 2)
