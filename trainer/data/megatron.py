"""Megatron-LM's IndexedDataset (`prefix.bin` + `prefix.idx`), so data tokenized for Megatron can be reused.

`.bin` holds every sequence's tokens back to back. `.idx` layout (little-endian):
    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    u64       S, number of sequences
    u64       D, number of entries of the document index (documents + 1: it starts at 0)
    i32[S]    sequence lengths, in tokens
    i64[S]    sequence pointers, byte offsets into .bin
    i64[D]    document index: sequence ids where documents end (a leading 0, then one per document)
    (i8[S]    sequence modes, multimodal datasets only: ignored here)
The writer exists so tests (and users converting small corpora) can create real files in this format.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from moe_launch.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index entries


def _code_of(dtype: np.dtype) -> int:
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    names = [np.dtype(d).name for d in DTYPE_CODES.values()]
    raise ValueError(f"dtype {dtype} has no Megatron code; use one of {names}")


def write_indexed_dataset(prefix: str | Path, documents: Iterable[np.ndarray], dtype=np.uint16) -> None:
    """Write one sequence per document (the layout Megatron's preprocess_data.py produces without sentence split)."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype)
    code = _code_of(dtype)
    lengths: list[int] = []
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            arr = np.asarray(doc).astype(dtype, copy=False)
            f.write(arr.tobytes(order="C"))
            lengths.append(arr.size)
    lengths_S = np.asarray(lengths, dtype=np.int32)
    pointers_S = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        pointers_S[1:] = np.cumsum(lengths_S[:-1].astype(np.int64)) * dtype.itemsize
    doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, code, len(lengths), len(doc_index)))
        f.write(lengths_S.tobytes())
        f.write(pointers_S.tobytes())
        f.write(doc_index.tobytes())


@dataclass
class IndexedDataset:
    """Read-only view of a Megatron `.bin/.idx` pair; `tokens` is the memory-mapped token stream of `.bin`."""

    prefix: Path
    dtype: np.dtype
    lengths_S: np.ndarray
    pointers_S: np.ndarray
    doc_index: np.ndarray
    tokens: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.lengths_S.size)

    @property
    def num_documents(self) -> int:
        return max(int(self.doc_index.size) - 1, 0)

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.pointers_S[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.lengths_S[i])]


def _bad(prefix: Path, problem: str) -> DataError:
    return DataError(
        f"data.path={prefix} is not a readable Megatron IndexedDataset ({problem}); "
        "point data.path at the common prefix of a .bin/.idx pair (without the suffix), or use data.format=npy"
    )


def read_indexed_dataset(prefix: str | Path) -> IndexedDataset:
    prefix = Path(str(prefix).removesuffix(".bin").removesuffix(".idx")).expanduser()
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for p in (idx_path, bin_path):
        if not p.is_file():
            raise _bad(prefix, f"{p} is missing")
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    if raw.size < _HEADER.size:
        raise _bad(prefix, "the .idx file is truncated")
    magic, version, code, n_seq, n_doc = _HEADER.unpack(bytes(raw[:_HEADER.size]))
    if magic != MAGIC:
        raise _bad(prefix, f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _bad(prefix, f"unsupported version {version}")
    if code not in DTYPE_CODES:
        raise _bad(prefix, f"unknown dtype code {code}")
    dtype = np.dtype(DTYPE_CODES[code])
    if not np.issubdtype(dtype, np.integer):
        raise _bad(prefix, f"token dtype {dtype} is not an integer type")
    need = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if raw.size < need:
        raise _bad(prefix, f"the .idx file has {raw.size} bytes, its header promises at least {need}")
    offset = _HEADER.size
    lengths_S = np.frombuffer(raw, dtype=np.int32, count=n_seq, offset=offset)
    offset += lengths_S.nbytes
    pointers_S = np.frombuffer(raw, dtype=np.int64, count=n_seq, offset=offset)
    offset += pointers_S.nbytes
    doc_index = np.frombuffer(raw, dtype=np.int64, count=n_doc, offset=offset)
    bin_bytes = bin_path.stat().st_size
    if bin_bytes % dtype.itemsize:
        raise _bad(prefix, f".bin size {bin_bytes} is not a multiple of the {dtype} item size")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r") if bin_bytes else np.zeros(0, dtype=dtype)
    if n_seq:
        ends = pointers_S + lengths_S.astype(np.int64) * dtype.itemsize
        if (lengths_S < 0).any() or (pointers_S < 0).any() or int(ends.max()) > bin_bytes:
            raise _bad(prefix, "sequence pointers/lengths point outside the .bin file")
    return IndexedDataset(prefix, dtype, lengths_S, pointers_S, doc_index, tokens)


def concatenated_tokens(ds: IndexedDataset) -> np.ndarray:
    """The documents' tokens in sequence order as one stream; a zero-copy view when sequences are contiguous."""
    if ds.num_sequences == 0:
        return ds.tokens[:0]
    expected = np.zeros(ds.num_sequences, dtype=np.int64)
    expected[1:] = np.cumsum(ds.lengths_S[:-1].astype(np.int64)) * ds.dtype.itemsize
    if np.array_equal(expected, ds.pointers_S) and int(ds.pointers_S[0]) == 0:
        return ds.tokens[: int(ds.lengths_S.astype(np.int64).sum())]
    # rare (hand-built or filtered files): gather in sequence order into memory
    return np.concatenate([ds.sequence(i) for i in range(ds.num_sequences)])
