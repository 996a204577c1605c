"""The FP8 path's, the persistent TMA GEMMs' and the row kernels' Triton kernels compile for sm90 (sm90_compile.py):
what only a GPU run would otherwise catch (a construct the interpreter accepts and the compiler does not; rows of
1,000 elements read one element at a time) fails here on any machine with Triton's NVIDIA back end."""

from __future__ import annotations

import pytest
from kernel_helpers import run_compiled


def test_fp8_kernels_compile_for_sm90():
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Triton without its NVIDIA back end: {e}")
    out = run_compiled("sm90_compile.py")
    assert out.count("ok ") == 20, out
