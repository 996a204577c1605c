"""The FP8 path's Triton kernels compile for sm90 (sm90_compile.py): what only a GPU run would otherwise catch (a
construct the interpreter accepts and the compiler does not) fails here on any machine with Triton's NVIDIA
back end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_fp8_kernels_compile_for_sm90():
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Triton without its NVIDIA back end: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == 9, proc.stdout
