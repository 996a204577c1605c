"""Runs a benchmark script's smoke mode, as the tests of this folder do: from the repository root, one OpenMP thread,
Triton under its interpreter where the script launches kernels on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_smoke(script: str, *args: str, interpret: bool = True, timeout: int = 300,
              check: bool = True) -> subprocess.CompletedProcess:
    """`python benchmarks/<script> --smoke *args`; with check, asserts that it exited 0 (its output's tail in the
    message)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--smoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
