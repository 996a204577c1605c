"""Rotary position embeddings in the "rotate half" layout that OLMo / OLMoE (and HF Llama) use.

Shapes: B batch, H heads, S sequence, Dh head dim (even), P = Dh / 2 rotation pairs (dim i pairs with i + P).

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = [-x[P:], x[:P]]

The sign of rotate_half is folded into the table (`sin_signed_SDh` = [-sin, sin]), so the rotation needs only the
halves swapped (`flip` over a [2, P] view: one copy in the activation dtype, no negation pass, no torch.cat). The
tables stay fp32: `x * cos` with bf16 x and fp32 cos promotes to fp32 inside one kernel (no separate `.float()` copy of
x), `addcmul` adds the swapped term in the same fp32 pass, and the single cast back to x's dtype happens at the end:
the fp32 arithmetic of upcasting x first, in four kernels.

The backward is the inverse rotation (the transpose of a rotation is the rotation by -angle): with S the half swap
(symmetric) and S(sin_signed) = -sin_signed, grad_x = g * cos - S(g) * sin_signed, the same four kernels, instead of
autograd replaying the forward's mixed-dtype graph (about twice as many passes). Both run in fp32 as above.

Under torch.compile (`train.compile`) the formula goes to autograd instead: Inductor derives and fuses the backward
itself, and the hand-written one would only constrain it. torch 2.11 also mishandles this Function inside a compiled
graph: the backward it compiles is wrong in fp32 (the forward returns its own intermediate through a no-op cast), and a
recomputed attention sublayer keeps the rotated q and k.
"""

from __future__ import annotations

import torch
from torch import nn


def _swap_halves(x_BHSDh: torch.Tensor) -> torch.Tensor:
    return x_BHSDh.unflatten(-1, (2, x_BHSDh.shape[-1] // 2)).flip(-2).flatten(-2)  # [x[P:], x[:P]]


def _rotate(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor, sign: float) -> torch.Tensor:
    """x * cos + sign * swap(x) * sin, in the tables' fp32, returned in x's dtype."""
    out_BHSDh = torch.addcmul(x_BHSDh * cos_SDh, _swap_halves(x_BHSDh), sin_SDh, value=sign)
    return out_BHSDh.to(x_BHSDh.dtype)


class _RotaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos_SDh, sin_SDh)  # the tables only: no activation is kept
        return _rotate(x_BHSDh, cos_SDh, sin_SDh, 1.0)

    @staticmethod
    def backward(ctx, grad_BHSDh: torch.Tensor):
        cos_SDh, sin_SDh = ctx.saved_tensors
        return _rotate(grad_BHSDh, cos_SDh, sin_SDh, -1.0), None, None


def apply_rotary(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_signed_SDh: torch.Tensor) -> torch.Tensor:
    """Rotate x by the angles of the first S rows of the tables (sin with rotate_half's sign folded in)."""
    S = x_BHSDh.shape[-2]
    if torch.compiler.is_compiling():
        return _rotate(x_BHSDh, cos_SDh[:S], sin_signed_SDh[:S], 1.0)
    return _RotaryFn.apply(x_BHSDh, cos_SDh[:S], sin_signed_SDh[:S])


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        inv_freq_P = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles_SP = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq_P)
        # not persistent: derived from the config, so checkpoints stay independent of max_seq_len
        self.register_buffer("cos_SDh", torch.cat([angles_SP.cos()] * 2, dim=-1).float(), persistent=False)
        self.register_buffer("sin_signed_SDh", torch.cat([-angles_SP.sin(), angles_SP.sin()], dim=-1).float(),
                             persistent=False)

    def forward(self, x_BHSDh: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x_BHSDh, self.cos_SDh, self.sin_signed_SDh)
