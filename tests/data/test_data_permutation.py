"""The index-by-index seeded permutation: a bijection, deterministic, keyed, usable on a slice."""

import numpy as np
import pytest

from moe_launch.trainer.data.permutation import permute


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 65537])
def test_is_a_bijection(n):
    out = permute(np.arange(n), n, (1, 2))
    assert out.dtype == np.int64
    assert np.array_equal(np.sort(out), np.arange(n))


def test_deterministic_keyed_and_sliceable():
    n = 5000
    full = permute(np.arange(n), n, (9, 0))
    assert np.array_equal(full, permute(np.arange(n), n, (9, 0)))
    assert np.array_equal(full[1234:1300], permute(np.arange(1234, 1300), n, (9, 0)))
    assert not np.array_equal(full, permute(np.arange(n), n, (9, 1)))
    assert not np.array_equal(full, permute(np.arange(n), n, (10, 0)))
    # it shuffles: few fixed points, neighbours scattered
    assert (full == np.arange(n)).sum() < 20
    assert np.abs(np.diff(full)).mean() > n / 10


def test_rejects_out_of_range():
    with pytest.raises(IndexError):
        permute(np.array([10]), 10, (0,))
