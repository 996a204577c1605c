"""Triton's interpreter in this environment: the check that `make` runs, and the advice a launch gives when numpy
refuses the interpreter's scalar conversions (Triton < 3.7 under numpy >= 2.4)."""

from __future__ import annotations

import subprocess
import sys

import numpy
import pytest
import torch
import triton
import triton.language as tl
from helpers_gpu import host_gpu_env

from moe_launch.kernels._launch import launch
from moe_launch.kernels.interpreter_check import INTERPRETER_NUMPY_FIX, interpreter_runs

NUMPY_REFUSES = tuple(int(v) for v in numpy.__version__.split(".")[:2]) >= (2, 4)


@triton.jit
def _numpy_scalar_of_a_vector(x_ptr):
    # what Triton < 3.7's interpreter does with a loop bound, written out: numpy >= 2.4 refuses it
    tl.store(x_ptr, int(numpy.ones(1)))


def test_the_interpreter_runs_here():
    assert interpreter_runs() == (True, "")


def test_the_check_is_a_command_that_exits_zero_where_the_interpreter_runs():
    # a fresh process: the command sets TRITON_INTERPRET itself, also where the GPU is visible
    proc = subprocess.run([sys.executable, "-m", "moe_launch.kernels.interpreter_check"], env=host_gpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Triton's interpreter runs (triton ")


@pytest.mark.skipif(not NUMPY_REFUSES, reason="numpy < 2.4 converts one-element arrays to scalars")
def test_a_launch_refused_by_numpy_names_the_fix():
    with pytest.raises(RuntimeError) as info:
        launch(_numpy_scalar_of_a_vector, (1,), torch.zeros(1))
    assert str(info.value) == f"Triton kernel _numpy_scalar_of_a_vector: {INTERPRETER_NUMPY_FIX}"
    assert "numpy<2.4" in str(info.value) and "model.moe.impl=reference" in str(info.value)
