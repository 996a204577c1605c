"""FastSparseMoE kernels (issue 4): token counting, index generation, gather, grouped GEMM, output reduction.

Triton decides once, when `triton` is first imported, whether `@triton.jit` compiles or interprets (it reads
TRITON_INTERPRET then; the standard library's own jit functions such as tl.sum are decorated at that moment). On a
host without a CUDA device compiled kernels cannot run at all, so if triton is not imported yet we ask for the
interpreter before the kernel modules import it. On a GPU host nothing is changed.
"""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
