"""tests/parallel: one intra-op thread in the test process too (the reference runs; spawned ranks set their own).
Tiny tensors on a shared 2-core machine are many times slower with a thread pool than without."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_thread_torch():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def rank_pool():
    """Four worker processes for the whole session; each job makes its own gloo group (see par_harness)."""
    from par_harness import RankPool

    pool = RankPool(4)
    yield pool
    pool.close()
