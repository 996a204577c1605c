"""The host's GPUs, kept apart from the suite's own processes.

The suite is the CPU suite wherever it runs: multi-rank tests start gloo ranks, kernel tests interpret Triton on CPU
tensors, and results are compared bit for bit with CPU runs. On a GPU host the trainer would otherwise pick CUDA on
its own (trainer/dist.py) and start NCCL with several ranks on one GPU, which NCCL refuses. So tests/conftest.py hides
the GPUs from every process of the suite (`hide_host_gpus`, before torch is imported), and the tests that exercise a
GPU run a script in a child process that gets the host's devices back (`run_on_host_gpu`, `host_gpu_env`), skipping
where `host_gpu_capability()` finds none.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

# What CUDA_VISIBLE_DEVICES was before the suite hid the GPUs; UNSET when it was not set at all.
SAVED_KEY = "MOE_TEST_HOST_CUDA_VISIBLE_DEVICES"
UNSET = "<unset>"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def hide_host_gpus() -> None:
    """Make the suite's processes see no GPU; xdist workers and subprocesses inherit both variables. Idempotent (a
    worker re-imports the conftest with the variables already set)."""
    if SAVED_KEY not in os.environ:
        os.environ[SAVED_KEY] = os.environ.get("CUDA_VISIBLE_DEVICES", UNSET)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def host_gpu_env(base: Optional[dict] = None) -> dict:
    """`base` (default: this process's environment) with the host's GPUs visible again and without TRITON_INTERPRET,
    for a child process that runs compiled kernels (Triton fixes its mode when it is imported)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in ("TRITON_INTERPRET", SAVED_KEY)}
    # the child is a script of a test folder: it imports this folder's helpers as the suite's modules do
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, env.get("PYTHONPATH", "")) if p)
    saved = os.environ.get(SAVED_KEY, UNSET)
    if saved == UNSET:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = saved
    return env



def run_on_host_gpu(script: Path) -> str:
    """Run a test folder's `script` in a child with the host's GPUs and compiled Triton (`host_gpu_env`); assert it
    exited 0 and return its stdout."""
    proc = subprocess.run([sys.executable, str(script)], env=host_gpu_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout

@functools.lru_cache(maxsize=1)
def host_gpu_capability() -> Optional[tuple[int, int]]:
    """(major, minor) of the first GPU the suite's child processes would use, or None on a host without one. Asks
    nvidia-smi, not torch: CUDA must stay uninitialised in the suite's own processes."""
    saved = os.environ.get(SAVED_KEY, os.environ.get("CUDA_VISIBLE_DEVICES", UNSET))
    if saved.strip() in ("", "-1"):
        return None
    first = "0" if saved == UNSET else saved.split(",")[0].strip()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader", "-i", first],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    try:
        major, minor = line.split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def host_has_gpu(min_major: int = 0) -> bool:
    cap = host_gpu_capability()
    return cap is not None and cap[0] >= min_major
