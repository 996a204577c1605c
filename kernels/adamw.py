"""AdamW update over one flat shard in a single pass, with the fp32 master either the parameters themselves (fp32) or
split across the bf16 parameters and a 16-bit remainder (bf16) — Triton kernel beside its plain-torch reference.

Shapes: N elements of one optimizer shard (flat, contiguous).

Why a remainder instead of an fp32 master copy. With bf16 parameters an fp32 master costs 4 bytes per parameter on
top of the 2 of the parameter itself. An fp32 number's bit pattern is exactly (its bf16 rounding) << 16 plus a small
signed correction, so the master is kept as the bf16 parameter (the high half, what the model computes with) plus an
int16 remainder: 2 bytes instead of 4, bit-exact fp32 master arithmetic, and the update writes the model's bf16
weights in the same pass (no separate cast-and-copy). Transformer Engine's FusedAdam offers the same trade
(`store_param_remainders`). Rounding is to nearest with ties away from zero (round-to-nearest-even cannot be undone
from 16 remainder bits at a tie), so a master exactly halfway between two bf16 values maps to the larger magnitude.

    bits32 = (bits16(param) << 16) + remainder          (int32 arithmetic modulo 2^32; remainder in [-2^15, 2^15))
    hi16   = (bits32 + 2^15) >> 16,  remainder = bits32 - (hi16 << 16)

Update (torch.optim.AdamW's rule: decoupled weight decay, bias correction, eps outside the sqrt), with the gradient
read in its own dtype and multiplied by `grad_scale` (the clip coefficient) in fp32:

    p <- p * (1 - lr * wd);  m <- m + (1 - b1) (g - m);  v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch

BLOCK = 2048


@dataclass(frozen=True)
class AdamWScalars:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # 1-based, after increment
    grad_scale: float = 1.0

    @property
    def step_size(self) -> float:
        return self.lr / (1 - self.beta1**self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return math.sqrt(1 - self.beta2**self.step)


# -- master <-> (bf16 parameter, remainder) --------------------------------------------------------------------------
def split_master(master_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master -> (bf16 high half rounded to nearest, ties away from zero; int16 remainder)."""
    bits = master_N.contiguous().view(torch.int32)
    hi = ((bits + 0x8000) >> 16) & 0xFFFF  # arithmetic shift, then the low 16 bits: the logical shift's result
    lo = bits - (hi << 16)  # modulo 2^32: in [-2^15, 2^15)
    hi_signed = torch.where(hi >= 0x8000, hi - 0x10000, hi)
    return hi_signed.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def join_master(param_N: torch.Tensor, rem_N: torch.Tensor) -> torch.Tensor:
    """(bf16 parameter, int16 remainder) -> the fp32 master it encodes."""
    hi = param_N.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    bits = (hi << 16) + rem_N.to(torch.int32)  # the int32 wrap of (hi << 16) is the sign bit: intended
    return bits.view(torch.float32)


# -- reference -------------------------------------------------------------------------------------------------------
def adamw_reference_(master_N: torch.Tensor, exp_avg_N: torch.Tensor, exp_avg_sq_N: torch.Tensor,
                     grad_N: torch.Tensor, s: AdamWScalars) -> None:
    """In place on an fp32 master: the element-wise sequence of torch.optim.AdamW's single-tensor path (bitwise equal
    to it on CPU for grad_scale 1)."""
    g = grad_N if grad_N.dtype == torch.float32 else grad_N.float()
    if s.grad_scale != 1.0:
        g = g * s.grad_scale
    if s.weight_decay:
        master_N.mul_(1 - s.lr * s.weight_decay)
    exp_avg_N.lerp_(g, 1 - s.beta1)
    exp_avg_sq_N.mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
    denom = (exp_avg_sq_N.sqrt() / s.bias_correction2_sqrt).add_(s.eps)
    master_N.addcdiv_(exp_avg_N, denom, value=-s.step_size)


# -- Triton ----------------------------------------------------------------------------------------------------------
@triton.jit
def _adamw_kernel(
    p_ptr, rem_ptr, m_ptr, v_ptr, g_ptr, N,
    lr, decay, beta1, beta2, eps, step_size, bc2_sqrt, grad_scale,
    HAS_REM: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    if HAS_REM:  # p_ptr is the bf16 parameter seen as int16
        hi = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        rem = tl.load(rem_ptr + offs, mask=mask, other=0).to(tl.int32)
        p = ((hi << 16) + rem).to(tl.float32, bitcast=True)
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt_rn(v) / bc2_sqrt + eps))
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_REM:
        bits = p.to(tl.int32, bitcast=True)
        hi = ((bits + 0x8000) >> 16) & 0xFFFF
        rem = bits - (hi << 16)
        hi = tl.where(hi >= 0x8000, hi - 0x10000, hi)
        tl.store(p_ptr + offs, hi.to(tl.int16), mask=mask)
        tl.store(rem_ptr + offs, rem.to(tl.int16), mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)


def adamw_fused_(param_N: torch.Tensor, rem_N: Optional[torch.Tensor], exp_avg_N: torch.Tensor,
                 exp_avg_sq_N: torch.Tensor, grad_N: torch.Tensor, s: AdamWScalars) -> None:
    """One pass: read parameter (+ remainder), moments and gradient; write them back. `param_N` is fp32 (then it is
    the master and `rem_N` is None) or bf16 with its int16 remainder."""
    n = param_N.numel()
    for t in (param_N, exp_avg_N, exp_avg_sq_N, grad_N) + ((rem_N,) if rem_N is not None else ()):
        if t.numel() != n or not t.is_contiguous():
            raise ValueError("adamw_fused_ needs contiguous tensors of equal length")
    if n == 0:
        return
    has_rem = rem_N is not None
    if has_rem != (param_N.dtype == torch.bfloat16) or (not has_rem and param_N.dtype != torch.float32):
        raise ValueError(f"parameters of dtype {param_N.dtype} need {'no ' if not has_rem else ''}remainder; "
                         "supported: fp32 parameters, or bf16 parameters with an int16 remainder")
    p = param_N.view(torch.int16) if has_rem else param_N
    launch(_adamw_kernel, (triton.cdiv(n, BLOCK),), p, rem_N if has_rem else p, exp_avg_N, exp_avg_sq_N, grad_N, n,
           s.lr, 1 - s.lr * s.weight_decay, s.beta1, s.beta2, s.eps, s.step_size, s.bias_correction2_sqrt,
           s.grad_scale, HAS_REM=has_rem, BLOCK=BLOCK, num_warps=8)
