"""kernels/_launch.launch: a compiled kernel handed CPU tensors fails with the message that says what to do, not
Triton's own error (run in a subprocess without TRITON_INTERPRET, with triton imported first: compiled mode)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import triton
    import triton.language as tl
    import torch
    from moe_launch.kernels._launch import launch

    @triton.jit
    def _fill(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, 1.0, mask=offs < n)

    try:
        launch(_fill, (1,), torch.zeros(4), 4, BLOCK=8)
    except RuntimeError as e:
        print("RAISED", e)
""")


def test_compiled_kernel_on_cpu_tensors_says_how_to_run_on_the_cpu(tmp_path):
    # the child sees no GPU on any host (tests/helpers_gpu.py hides them from the suite): a CPU host's situation
    script = tmp_path / "launch_on_cpu.py"  # @triton.jit needs its function's source file
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert "RAISED Triton kernel _fill got CPU tensors" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "TRITON_INTERPRET=1" in proc.stdout


def test_unit_of_is_the_largest_power_of_two_up_to_16_dividing_every_int():
    from moe_launch.kernels._launch import unit_of
    assert unit_of(2048, 4096) == 16  # what Triton already knows of such ints
    assert unit_of(1000, 2000) == 8   # a row of 1,000 bf16 elements: 16-byte vectors
    assert unit_of(1000, 2000, 204) == 4
    assert unit_of(100, 6) == 2
    assert unit_of(2048, 1) == 1      # a unit stride among them: nothing to gain
    assert unit_of(0, 24) == 8        # a stride of 0 (an unused operand) constrains nothing
    assert unit_of() == 16


def test_row_buffer_starts_rows_at_cache_lines_and_is_contiguous_where_they_fill_lines():
    import torch

    from moe_launch.kernels._launch import row_buffer
    b = row_buffer(3, 1000, torch.bfloat16, torch.device("cpu"))
    assert b.shape == (3, 1000) and b.stride() == (1024, 1)
    assert row_buffer(3, 2048, torch.bfloat16, torch.device("cpu")).is_contiguous()
    assert row_buffer(2, 200, torch.float8_e4m3fn, torch.device("cpu")).stride() == (256, 1)  # 128 e4m3 per line
    assert row_buffer(2, 8, torch.float32, torch.device("cpu")).stride() == (32, 1)
