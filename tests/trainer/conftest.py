"""Fixtures of the trainer tests; the helpers live in trainer_harness.py."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """Cache dir in which the built-in corpus gets tokenized once for the whole session (vocab 512, seq 32)."""
    return str(tmp_path_factory.mktemp("data-cache"))



@pytest.fixture(autouse=True)
def _restore_determinism():
    """In-process Trainers switch torch's deterministic mode on; later tests of the suite must not inherit it."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)
