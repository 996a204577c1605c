"""One place that launches our Triton kernels, and says clearly why a CPU launch cannot work when it cannot.

Triton chooses compiled or interpreted at decoration time (see kernels/__init__.py), so a kernel is either a
JITFunction (GPU only) or an InterpretedFunction (runs anywhere; tensors are copied through host numpy arrays).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

from .interpreter_check import INTERPRETER_NUMPY_FIX, NUMPY_ERROR


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    # the arguments are looked at only once a launch has failed: a layer call launches dozens of kernels, and on
    # small inputs their host time is the layer's time
    try:
        kernel[grid](*args, **meta)
    except Exception as e:
        if isinstance(kernel, JITFunction) and any(isinstance(a, torch.Tensor) and a.device.type == "cpu"
                                                   for a in args):
            raise RuntimeError(
                f"Triton kernel {kernel.fn.__name__} got CPU tensors but triton was imported in compiled mode. "
                "Set TRITON_INTERPRET=1 before anything imports triton (or import moe_launch.kernels first), "
                "or use model.moe.impl=reference on machines without a GPU."
            ) from e
        if not isinstance(kernel, JITFunction) and NUMPY_ERROR in str(e):
            raise RuntimeError(f"Triton kernel {kernel.fn.__name__}: {INTERPRETER_NUMPY_FIX}") from e
        raise


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The CUDA device's SM count, asked once per device (persistent kernels size their grids by it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _scratch(size: int, align: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_allocator() -> None:
    """Device-side TMA descriptors need scratch memory from the caller's allocator (torch's, here). Set before every
    launch of a kernel that makes them: Triton keeps it in a context variable, so one set in the autograd engine's
    device thread is not seen by a launch from the main thread (a CUDA graph capturing the backward there)."""
    triton.set_allocator(_scratch)


def unit_of(*ints: int) -> int:
    """The largest power of two up to 16 that divides every one of ints: the unit in which a kernel takes its row
    strides and the length of its unit-stride dim. Triton knows of an integer argument only whether it is a multiple
    of 16, so a row of 1,000 bf16 elements would otherwise be read and written one element at a time (ld/st.global.b16,
    eight times the instructions of .v4). Such a kernel takes the ints divided by the unit and multiplies them back by
    it as a constexpr, and the compiler sees the product's divisibility. Pure."""
    unit = 16
    while unit > 1 and any(int(i) % unit for i in ints):
        unit //= 2
    return unit


ROW_PITCH_BYTES = 128  # one L2 cache line; 64 bf16 or 128 e4m3 elements


def row_buffer(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized [rows, width] buffer whose rows start at cache-line boundaries (ROW_PITCH_BYTES apart, width
    rounded up). The grouped GEMMs read row tiles through TMA: rows of 1,000 bf16 elements would start at every 16th
    byte of a line, and each 128-byte tile row would then span two lines. At widths that fill whole lines it is a
    plain contiguous tensor."""
    per_line = max(1, ROW_PITCH_BYTES // dtype.itemsize)
    pitch = -(-width // per_line) * per_line
    buf = torch.empty(rows, pitch, dtype=dtype, device=device)
    return buf if pitch == width else buf[:, :width]
