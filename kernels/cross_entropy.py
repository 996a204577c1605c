"""Softmax cross-entropy of one chunk of the output head's logits, and its gradient, in one kernel.

Shapes: C tokens of the chunk, V vocabulary.

    loss_C = softmax_xent_(logits_CV, y_C, ignore_index, write_grad)

loss_C[c] = logsumexp(logits_CV[c]) - logits_CV[c, y_C[c]] in fp32 (0 where y_C[c] == ignore_index). With
write_grad the logits are overwritten, in their own dtype, by softmax(logits_CV[c]) - onehot(y_C[c]) (no onehot on
ignored rows), the gradient of the summed loss before any per-token scale. The torch path it replaces, and its
reference, is trainer/model/loss.py `softmax_xent_torch`: a log_softmax into a new fp32 C x V tensor, an exp over it,
a scatter and a cast back, four passes over the chunk's largest tensor in fp32. Here each row is read twice (the
second time mostly from L2) and written once, in the logits' dtype, and no fp32 C x V buffer is allocated.

Math in fp32, as log_softmax upcasts inside its kernel: an online max and sum of exp over the row's blocks, then
p = exp(x - lse).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2, unit_of


@triton.jit
def _softmax_xent_kernel(
    logits_ptr, y_ptr, loss_ptr,  # logits [C, V] (the gradient written over them if WRITE_GRAD); y [C]; loss fp32 [C]
    V, stride_row, ignore_index,
    WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, UNIT: tl.constexpr,
):
    V, stride_row = V * UNIT, stride_row * UNIT  # passed divided by UNIT (_launch.unit_of): 16-byte vectors
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    y = tl.load(y_ptr + row)
    valid = y != ignore_index
    m = -float("inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    y_safe = tl.where(valid, y, 0)
    x_y = tl.load(base + y_safe).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_y, 0.0))
    if WRITE_GRAD:
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < V
            x = tl.load(base + cols, mask=ok, other=-float("inf")).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where((cols == y_safe) & valid, p - 1.0, p)
            tl.store(base + cols, p.to(logits_ptr.dtype.element_ty), mask=ok)


def softmax_xent_(logits_CV: torch.Tensor, y_C: torch.Tensor, ignore_index: int, write_grad: bool) -> torch.Tensor:
    """Per-token loss (fp32 [C]); with write_grad, logits_CV (rows contiguous) now holds softmax - onehot."""
    if logits_CV.stride(1) != 1:
        raise ValueError("softmax_xent_ needs the logits' rows contiguous (it writes the gradient over them)")
    C, V = logits_CV.shape
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C == 0:
        return loss_C
    BLOCK_V = min(next_pow2(V), 4096 if logits_CV.is_cuda else 1024)
    u = unit_of(V, logits_CV.stride(0))
    launch(_softmax_xent_kernel, (C,), logits_CV, y_C, loss_C, V // u, logits_CV.stride(0) // u, ignore_index,
           WRITE_GRAD=write_grad, BLOCK_V=BLOCK_V, UNIT=u, num_warps=8)
    return loss_C
