"""Kernel tests run Triton's interpreter on the CPU.

Triton reads TRITON_INTERPRET when `triton` is first imported (its standard library, e.g. tl.sum, is decorated
then), so it is set here, before any test module of this folder imports moe_launch.kernels. On a machine without
CUDA, moe_launch.kernels sets the same default itself; on a GPU machine the variable makes these tests interpret
too (slow but equal), and leaves compiled kernels to benchmarks/moe_layer.py.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
