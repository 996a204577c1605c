"""A seeded permutation of [0, n) evaluated index by index, in O(1) memory.

Shuffling a pretraining set with `rng.permutation(n)` costs 8 bytes per instance (10 GB for the 1.2e9 instances of
a 5T-token set at 4k context), every rank would hold a copy, and every new epoch recomputes it. Instead we use a
Feistel network on the smallest even number of bits covering n, with cycle-walking: a bijection on [0, 2^m) whose
values >= n are pushed through the network again until they land inside [0, n). The result is a bijection on
[0, n), so every instance is seen exactly once per epoch, and any position can be looked up on its own.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np

_ROUNDS = 6
_MIX1 = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xBF58476D1CE4E5B9)
_MIX3 = np.uint64(0x94D049BB133111EB)


@lru_cache(maxsize=64)
def _round_keys(key: tuple[int, ...]) -> np.ndarray:
    # cached: SeedSequence costs far more than permuting a batch of positions
    return np.random.SeedSequence([k & 0xFFFFFFFF for k in key]).generate_state(_ROUNDS, dtype=np.uint64)


def _mix(x: np.ndarray, k: np.uint64) -> np.ndarray:
    # splitmix64's finaliser: every input bit flips about half the output bits
    z = (x + k) * _MIX1
    z ^= z >> np.uint64(30)
    z *= _MIX2
    z ^= z >> np.uint64(27)
    z *= _MIX3
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half_bits: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    left, right = x >> shift, x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right, k) & mask)
    return (left << shift) | right


def permute(idx: np.ndarray, n: int, key: Sequence[int]) -> np.ndarray:
    """The image of positions `idx` (each in [0, n)) under the permutation of [0, n) named by `key`. int64 out."""
    idx = np.asarray(idx, dtype=np.int64)
    if n <= 1:
        return idx.copy()
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"positions must lie in [0, {n})")
    bits = max(2, int(n - 1).bit_length())
    half_bits = (bits + 1) // 2
    keys = _round_keys(tuple(int(k) for k in key))
    y = _feistel(idx.astype(np.uint64), half_bits, keys)
    # cycle-walking: fewer than 4 passes on average since 2^(2*half_bits) < 4n
    outside = y >= np.uint64(n)
    while outside.any():
        y[outside] = _feistel(y[outside], half_bits, keys)
        outside = y >= np.uint64(n)
    return y.astype(np.int64)
