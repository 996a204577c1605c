"""Helpers of the kernel tests (imported by the test modules of this folder): error metric, random routing, and
running a script of this folder with Triton compiling rather than interpreting."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

_draws: dict[str, tuple[int, int]] = {}  # by test id: its seed and the generators drawn so far


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b (the metric of the kernels' tolerances)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def input_generator() -> torch.Generator:
    """The generator of a random-input test's inputs.

    The test's seed comes from its id, so every run of the suite draws the same inputs and a failure reproduces;
    the k-th generator a test draws is seeded with seed + k. KERNEL_TEST_SEED=random draws a fresh seed each run (to
    search for failures); KERNEL_TEST_SEED=N reruns one. The seed is printed: pytest shows it on failure.
    """
    test_id = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    if test_id not in _draws:
        choice = os.environ.get("KERNEL_TEST_SEED", "")
        if choice == "random":
            seed = torch.seed() % 2**31
        else:
            seed = int(choice) if choice else zlib.crc32(test_id.encode()) % 2**31
        _draws[test_id] = (seed, 0)
    seed, draw = _draws[test_id]
    _draws[test_id] = (seed, draw + 1)
    print(f"inputs of {test_id}: KERNEL_TEST_SEED={seed} (generator {draw})")
    return torch.Generator().manual_seed(seed + draw)


def random_idx(T: int, K: int, num_experts: int, gen: torch.Generator, skip: range = range(0)) -> torch.Tensor:
    """[T, K] distinct top-k experts per token, never choosing the experts in `skip` (they get zero tokens)."""
    pool = torch.tensor([e for e in range(num_experts) if e not in skip])
    assert len(pool) >= K
    scores = torch.rand(T, len(pool), generator=gen)
    return pool[scores.topk(K, dim=1).indices]


def run_compiled(script: str) -> str:
    """Run this folder's `script` on the host's GPU, in a process without TRITON_INTERPRET (the tests here interpret
    Triton, and a mode is fixed when triton is imported); assert it exited 0 and return its stdout."""
    # imported here: the GPU scripts import this module too, and run by hand (`python tests/kernels/gpu_X.py`) they
    # do not have the suite's folder, where helpers_gpu lives, on their path
    from helpers_gpu import run_on_host_gpu
    return run_on_host_gpu(Path(__file__).with_name(script))
