"""On-disk token datasets behind one interface: `n_instances` rows of `seq_len + 1` tokens, read by row id.

Two formats: prepared `.npy` shards (`shards.py`; rows pre-shuffled across all input files) and Megatron
IndexedDataset pairs (`megatron.py`; the concatenated token stream cut into consecutive rows, in document order).
Opening validates everything that can be checked cheaply, so a bad dataset fails before the first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_launch.errors import DataError
from moe_launch.trainer.data import megatron, shards

_VOCAB_SCAN_TOKENS = 1 << 30  # Megatron files carry no max token id: scan at most this many tokens on open


@dataclass
class TokenDataset:
    path: Path
    fmt: str
    seq_len: int
    n_instances: int
    shuffled_on_disk: bool  # True: position i can be served as row i in the first epoch
    max_token_id: int
    _shards: list[np.ndarray]  # npy: one [count, L_ds+1] memmap per shard; megatron: one [n, seq_len+1] view
    _starts: np.ndarray  # first row id of each shard

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` as a [len(ids), seq_len+1] array in the file's dtype (cropped when the file's rows are longer)."""
        width = self.seq_len + 1
        ids = np.asarray(ids, dtype=np.int64)
        which = np.searchsorted(self._starts, ids, side="right") - 1
        local = ids - self._starts[which]
        if ids.size and which[0] == which[-1] and local[-1] - local[0] == ids.size - 1 and (
            ids.size == 1 or (np.diff(local) == 1).all()
        ):
            return np.array(self._shards[which[0]][local[0]:local[-1] + 1, :width])  # one sequential read
        out = np.empty((ids.size, width), dtype=self._shards[0].dtype)
        if ids.size <= 256:  # a batch: row by row beats grouping by shard at this size
            for j, (s, r) in enumerate(zip(which.tolist(), local.tolist())):
                out[j] = self._shards[s][r, :width]
            return out
        for s in np.unique(which):
            sel = which == s
            out[sel] = self._shards[s][local[sel], :width]
        return out


def _check_seq_len(seq_len: int, available: int, path: Path) -> None:
    if seq_len > available:
        raise DataError(
            f"train.seq_len={seq_len} is longer than the instances of {path} ({available} tokens + 1); "
            f"lower train.seq_len to at most {available}, or re-run `moe-data prepare --seq-len {seq_len}`"
        )


def _check_vocab(max_token_id: int, vocab_size: int | None, path: Path) -> None:
    if vocab_size is not None and max_token_id >= vocab_size:
        raise DataError(
            f"{path} holds token id {max_token_id}, but model.vocab_size={vocab_size}; raise model.vocab_size to at "
            f"least {max_token_id + 1} (the tokenizer's vocabulary) or prepare the data with a matching tokenizer"
        )


def _open_npy(path: Path, seq_len: int, vocab_size: int | None) -> TokenDataset:
    index = shards.read_index(path)
    _check_seq_len(seq_len, index.seq_len, path)
    _check_vocab(index.max_token_id, vocab_size, path)
    arrays = shards.open_shards(path, index)
    if not arrays or index.total_instances == 0:
        raise DataError(f"{path} holds no instances; add text or lower --seq-len ({shards.prepare_hint(path)})")
    counts = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return TokenDataset(path, "npy", seq_len, int(counts.sum()), True, index.max_token_id, arrays, starts)


def _open_megatron(prefix: Path, seq_len: int, vocab_size: int | None) -> TokenDataset:
    ds = megatron.read_indexed_dataset(prefix)
    stream = megatron.concatenated_tokens(ds)
    width = seq_len + 1
    n = stream.size // width
    if n == 0:
        raise DataError(
            f"data.path={prefix} holds {stream.size} tokens, fewer than one instance of train.seq_len+1={width}; "
            "use more data or lower train.seq_len"
        )
    scanned = stream[: min(stream.size, _VOCAB_SCAN_TOKENS)]
    lowest, highest = int(scanned.min()), int(scanned.max())
    if lowest < 0:
        raise DataError(f"data.path={prefix} holds a negative token id ({lowest}); the .bin file is corrupt")
    _check_vocab(highest, vocab_size, prefix)
    rows = stream[: n * width].reshape(n, width)
    return TokenDataset(prefix, "megatron", seq_len, n, False, highest, [rows], np.zeros(1, dtype=np.int64))


def open_dataset(path: str | Path, fmt: str, seq_len: int, vocab_size: int | None = None) -> TokenDataset:
    """Open and validate a dataset; `vocab_size` (the model's) bounds the token ids, None skips that check."""
    if seq_len < 1:
        raise DataError(f"train.seq_len={seq_len}; use a positive context length")
    path = Path(path).expanduser()
    if fmt == "npy":
        return _open_npy(path, seq_len, vocab_size)
    if fmt == "megatron":
        return _open_megatron(path, seq_len, vocab_size)
    raise DataError(f"data.format={fmt!r} is unknown; use npy (moe-data prepare) or megatron (.bin/.idx)")
