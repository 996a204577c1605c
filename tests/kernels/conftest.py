"""Kernel tests run Triton's interpreter on the CPU.

Triton reads TRITON_INTERPRET when `triton` is first imported (its standard library, e.g. tl.sum, is decorated
then), so it is set here, before any test module of this folder imports moe_launch.kernels. On a machine without
CUDA, moe_launch.kernels sets the same default itself, and the suite hides a GPU host's devices (tests/helpers_gpu.py):
the compiled kernels are tested by this folder's gpu_*.py scripts, each run in a child process that sees the GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
