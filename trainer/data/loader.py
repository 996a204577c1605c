"""TokenLoader: the batch of a step is a pure function of (dataset, seed, global batch, step).

The data stream is an endless sequence of positions 0, 1, 2, ...; position p is instance `order_e(p mod n)` of
epoch e = p // n, where n is the number of instances. Global batch `step` covers positions
[step * B, (step + 1) * B); DP rank r of R reads its contiguous slice [r * B/R, (r + 1) * B/R) of it, so the slices
of all ranks concatenate to the single-rank batch. Epoch orders:
  - epoch 0 of a prepared (npy) dataset is the on-disk order, already shuffled across all input files by
    `moe-data prepare`, so the first pass reads every shard sequentially;
  - every later epoch, and every epoch of a Megatron dataset (stored in document order), is a seeded permutation
    (`permutation.permute`, keyed by (seed, epoch)) computed per position, never materialised.
Because the data position is the step, a run resumed at step k sees exactly the tokens an uninterrupted run would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_launch.errors import DataError
from moe_launch.trainer.data.dataset import TokenDataset, open_dataset
from moe_launch.trainer.data.permutation import permute

STATE_VERSION = 1
# up to this many instances an epoch's order is computed once (<= 4 MB, ~0.4 s) and cached; above, per batch
_CACHED_ORDER_MAX = 1 << 20


class TokenLoader:
    def __init__(
        self,
        path: str | Path,
        fmt: str,
        seq_len: int,
        global_batch: int,
        data_rank: int = 0,
        data_size: int = 1,
        seed: int = 0,
        vocab_size: int | None = None,
    ):
        if data_size < 1 or not 0 <= data_rank < data_size:
            raise DataError(f"data rank {data_rank} of {data_size} does not exist; check parallel.dp / parallel.ep")
        if global_batch < 1 or global_batch % data_size:
            raise DataError(
                f"train.global_batch_size={global_batch} cannot be split evenly over {data_size} data-parallel "
                f"ranks; use a multiple of {data_size}"
            )
        self.dataset: TokenDataset = open_dataset(path, fmt, seq_len, vocab_size)
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.local_batch = global_batch // data_size
        self.data_rank = data_rank
        self.data_size = data_size
        self.seed = seed
        self.vocab_size = vocab_size
        self.position = 0  # global instances consumed: (last step fetched + 1) * global_batch
        self._orders: dict[int, np.ndarray] = {}  # epoch -> full order, for small datasets

    def _permuted(self, within: np.ndarray, epoch: int) -> np.ndarray:
        n = self.dataset.n_instances
        if n > _CACHED_ORDER_MAX:
            return permute(within, n, (self.seed, epoch))
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}  # a batch spans <= 2 epochs
            self._orders[epoch] = permute(np.arange(n), n, (self.seed, epoch)).astype(np.int32)
        return self._orders[epoch][within].astype(np.int64)

    @property
    def n_instances(self) -> int:
        return self.dataset.n_instances

    @property
    def next_step(self) -> int:
        return self.position // self.global_batch

    def instance_ids(self, step: int) -> np.ndarray:
        """Row ids this rank reads for global batch `step` (pure; used by get and by tests)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.dataset.n_instances
        first = step * self.global_batch + self.data_rank * self.local_batch
        positions = np.arange(first, first + self.local_batch, dtype=np.int64)
        epochs, within = np.divmod(positions, n)
        ids = np.empty_like(within)
        for epoch in np.unique(epochs):  # a batch spans at most two epochs unless B > n
            sel = epochs == epoch
            if epoch == 0 and self.dataset.shuffled_on_disk:
                ids[sel] = within[sel]
            else:
                ids[sel] = self._permuted(within[sel], int(epoch))
        return ids

    def get(self, step: int) -> torch.Tensor:
        """This rank's slice of global batch `step`: int64 [global_batch / data_size, seq_len + 1]."""
        rows_BL = self.dataset.rows(self.instance_ids(step))
        if self.vocab_size is not None:
            highest = int(rows_BL.max())
            if highest >= self.vocab_size:
                raise DataError(
                    f"step {step} reads token id {highest} from {self.dataset.path}, but model.vocab_size="
                    f"{self.vocab_size}; raise model.vocab_size or prepare the data with a matching tokenizer"
                )
        self.position = (step + 1) * self.global_batch
        return torch.from_numpy(rows_BL.astype(np.int64))

    def state_dict(self) -> dict[str, Any]:
        n = self.dataset.n_instances
        return {
            "version": STATE_VERSION,
            "position": self.position,
            "epoch": self.position // n,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "n_instances": n,
            "seq_len": self.seq_len,
            "format": self.dataset.fmt,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; refuse a state from a different data stream (it would replay other tokens)."""
        for key, mine in (("seed", self.seed), ("global_batch", self.global_batch),
                          ("n_instances", self.dataset.n_instances), ("seq_len", self.seq_len)):
            if state.get(key) != mine:
                raise DataError(
                    f"the checkpoint's data state has {key}={state.get(key)}, this run has {mine}: resuming would "
                    "not replay the same tokens; keep train.seed, train.global_batch_size, train.seq_len and "
                    "data.path as in the checkpointed run, or start fresh from a model-only checkpoint"
                )
        self.position = int(state["position"])
