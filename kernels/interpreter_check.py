"""Can Triton's interpreter run our kernels in this environment? The CPU path of every kernel (and the kernel tests)
interprets Triton; the interpreter of Triton < 3.7 converts a loop bound to a Python int from a one-element numpy
array, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"). Triton's version
is fixed by torch's (torch 2.11 pins 3.6), so the remedy is numpy < 2.4 in that environment.

    python -m moe_launch.kernels.interpreter_check      # exit 0: it runs; 1: it does not, and what to do

`make` runs this when it builds the venv, and installs numpy < 2.4 into it when it fails. `INTERPRETER_NUMPY_FIX` is
also the advice of kernels/_launch.py when a launch fails this way.
"""

from __future__ import annotations

import os
import sys

NUMPY_ERROR = "only 0-dimensional arrays can be converted to Python scalars"
INTERPRETER_NUMPY_FIX = ("Triton's interpreter (the kernels' CPU path) before Triton 3.7 does not run under "
                         "numpy >= 2.4; install numpy<2.4 in this environment (pip install 'numpy<2.4'), use "
                         "Triton >= 3.7, or set model.moe.impl=reference")


def interpreter_runs() -> tuple[bool, str]:
    """Run a tiny kernel with a loop over a scalar argument in the interpreter: (ok, why not). Call it in a process
    whose triton is interpreting (TRITON_INTERPRET=1 before triton is first imported)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _cumulative(x_ptr, n, BLOCK: tl.constexpr):
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, offs.to(tl.float32), mask=offs < n)

    x = torch.zeros(10)
    try:
        _cumulative[(1,)](x, 10, BLOCK=4)
    except Exception as e:  # the interpreter wraps the numpy TypeError in its own error type
        return False, f"{type(e).__name__}: {e}"
    if not torch.equal(x, torch.arange(10, dtype=torch.float32)):
        return False, f"wrong result {x.tolist()}"
    return True, ""


def main() -> int:
    if "triton" in sys.modules:
        print("interpreter_check: triton was imported before TRITON_INTERPRET could be set", file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy
    import triton

    ok, why = interpreter_runs()
    versions = f"triton {triton.__version__}, numpy {numpy.__version__}"
    if ok:
        print(f"Triton's interpreter runs ({versions})")
        return 0
    print(f"Triton's interpreter fails ({versions}): {why}", file=sys.stderr)
    if NUMPY_ERROR in why:
        print(INTERPRETER_NUMPY_FIX, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
