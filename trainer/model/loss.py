"""Output head + cross-entropy without the whole batch's logits: chunked over tokens, gradients taken in the forward.

Shapes: T tokens (batch x sequence, flattened), D model dim, V vocabulary, C tokens of one chunk.

`F.cross_entropy(lm_head(h_TD).float(), y_T)` materialises T x V logits in the compute dtype, their fp32 copy, the
fp32 softmax and its gradient: at 16k tokens x 50k vocabulary that is several GiB written and read a few times. Here
each chunk of C tokens computes its logits (matmul in the compute dtype, like the autocast path), their fp32
log-softmax and loss, and at once the gradient of the mean loss with respect to its logits, (softmax - onehot) / N,
which it turns into the chunk's share of dh and dW with two more matmuls. Only dh_TD and dW_VD (fp32) live until
backward, which just scales them by the incoming gradient. FLOPs equal the unfused path's (one forward and two
backward matmuls); nothing is recomputed. Without grad (eval) no gradient is taken.

The softmax, loss and logit gradient of a chunk: on CUDA with `fused` (model.cross_entropy_fusion) one Triton kernel
over the chunk's logits in their own dtype (kernels/cross_entropy.py), else `softmax_xent_torch` below, its reference.

Numerics: the matmuls run in `compute_dtype` (the autocast dtype when autocast is on, else the weight's dtype) and
the softmax and loss in fp32, as in the reference. The per-token factor valid/N multiplies the C x D sides instead of
the C x V gradient: dh's rows in fp32 after their matmul, h's rows (rounded to compute_dtype) before dW's; dW is
accumulated in fp32 over chunks. `ignore_index` targets count neither in the loss nor in N, as in F.cross_entropy's
mean reduction.
"""

from __future__ import annotations

from typing import Optional

import torch

IGNORE_INDEX = -100
CHUNK_BYTES = 1 << 30  # what one chunk's logit-sized buffers may take together


def logit_bytes(compute_dtype: torch.dtype, fused: bool) -> int:
    """Bytes a chunk holds per logit: the fused kernel writes the gradient over the logits (one buffer in the
    compute dtype); torch's passes add an fp32 log-softmax (made the softmax in place) and the gradient's cast back."""
    return compute_dtype.itemsize if fused else 2 * compute_dtype.itemsize + 4


def chunk_tokens(vocab_size: int, bytes_per_logit: int) -> int:
    """Tokens per chunk: about CHUNK_BYTES of logit-sized buffers, a multiple of 128 rows for the matmuls. Longer
    chunks mean fewer, larger GEMMs (the head's dW accumulation and kernel launches amortise better)."""
    return max(128, (CHUNK_BYTES // (vocab_size * bytes_per_logit)) // 128 * 128)


def softmax_xent_torch(logits_CV: torch.Tensor, y_C: torch.Tensor, write_grad: bool):
    """Per-token loss (fp32; 0 for ignored targets) and, with write_grad, softmax - onehot in the logits' dtype (no
    onehot on ignored rows): the gradient of the summed loss before the per-token scale. The reference of
    kernels/cross_entropy.py `softmax_xent_`, and the path off CUDA."""
    # log_softmax upcasts inside its kernel: no separate fp32 copy of the logits
    logp_CV = torch.log_softmax(logits_CV, dim=-1, dtype=torch.float32)
    valid_C = y_C != IGNORE_INDEX
    y_safe_C = torch.where(valid_C, y_C, 0)
    loss_C = -torch.where(valid_C, logp_CV.gather(1, y_safe_C[:, None]).squeeze(1), 0.0)
    if not write_grad:
        return loss_C, None
    p_CV = logp_CV.exp_()  # softmax, in place of the chunk's fp32 buffer
    p_CV.scatter_add_(1, y_safe_C[:, None], -valid_C[:, None].to(p_CV.dtype))
    return loss_C, p_CV.to(logits_CV.dtype)


def _chunk_loss(h_CD: torch.Tensor, w_VD: torch.Tensor, y_C: torch.Tensor, n_valid: torch.Tensor, want_grad: bool,
                fused: bool):
    """Summed loss of one chunk and, if wanted, (softmax - onehot) in the matmul dtype with the per-token scale
    valid / N (fp32) that turns it into the gradient of the mean loss; the scale is applied to the C x D sides of the
    two gradient matmuls, not to the C x V matrix (one pass less over the chunk's largest tensor)."""
    logits_CV = h_CD @ w_VD.t()
    if fused:
        from moe_launch.kernels.cross_entropy import softmax_xent_  # imported lazily: triton is optional off CUDA

        loss_C = softmax_xent_(logits_CV, y_C, IGNORE_INDEX, want_grad)
        g_CV = logits_CV if want_grad else None  # the kernel wrote the gradient over the logits
    else:
        loss_C, g_CV = softmax_xent_torch(logits_CV, y_C, want_grad)
    if not want_grad:
        return loss_C.sum(), None, None
    return loss_C.sum(), g_CV, (y_C != IGNORE_INDEX).to(torch.float32) / n_valid


def _fp32_out_mm(a: torch.Tensor) -> bool:
    """Whether torch's GEMMs can take bf16/fp16 inputs and write fp32 (`out_dtype`, CUDA only, recent torch)."""
    global _FP32_OUT_MM
    if not a.is_cuda or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    if _FP32_OUT_MM is None:
        try:
            acc = torch.zeros(2, 2, device=a.device)
            x = torch.ones(2, 3, device=a.device, dtype=a.dtype)
            torch.addmm(acc, x, x.t(), out_dtype=torch.float32, out=acc)
            _FP32_OUT_MM = bool(torch.equal(acc, torch.full_like(acc, 3.0)))
        except (TypeError, RuntimeError):
            _FP32_OUT_MM = False
    return _FP32_OUT_MM


_FP32_OUT_MM = None


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_VD, y_T, compute_dtype, chunk, want_grad, fused):
        with torch.autocast(h_TD.device.type, enabled=False):
            hc_TD, wc_VD = h_TD.to(compute_dtype), w_VD.to(compute_dtype)
            valid_T = y_T != IGNORE_INDEX
            n_valid = valid_T.sum().clamp_min(1).to(torch.float32)  # stays on the device: no host sync
            total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
            dh_TD = torch.empty_like(hc_TD) if want_grad else None
            dw_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if want_grad else None
            for lo in range(0, h_TD.shape[0], chunk):
                h_CD, y_C = hc_TD[lo : lo + chunk], y_T[lo : lo + chunk]
                loss_sum, g_CV, scale_C = _chunk_loss(h_CD, wc_VD, y_C, n_valid, want_grad, fused)
                total += loss_sum
                if want_grad:
                    scale_C1 = scale_C[:, None]
                    hs_CD = (h_CD.float() * scale_C1).to(compute_dtype)
                    if _fp32_out_mm(g_CV):  # the GEMM writes / accumulates fp32 itself: no bf16 round trip
                        dh_TD[lo : lo + chunk] = torch.mm(g_CV, wc_VD, out_dtype=torch.float32).mul_(scale_C1)
                        torch.addmm(dw_VD, g_CV.t(), hs_CD, out_dtype=torch.float32, out=dw_VD)
                    else:
                        dh_TD[lo : lo + chunk] = (g_CV @ wc_VD).float().mul_(scale_C1)
                        dw_VD += (g_CV.t() @ hs_CD).float()
        ctx.save_for_backward(dh_TD, dw_VD)
        ctx.h_dtype, ctx.w_dtype = h_TD.dtype, w_VD.dtype
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        dh_TD, dw_VD = ctx.saved_tensors
        if dh_TD is None:
            raise RuntimeError("chunked_cross_entropy ran without grad enabled; run it with grad to backpropagate")
        # out of place (backward may run twice with retain_graph); a product with 1.0 is exact
        dh_TD = (dh_TD * grad_out.to(dh_TD.dtype)).to(ctx.h_dtype)
        dw_VD = (dw_VD * grad_out).to(ctx.w_dtype)
        return dh_TD, dw_VD, None, None, None, None, None


def chunked_cross_entropy(h_TD: torch.Tensor, w_VD: torch.Tensor, y_T: torch.Tensor,
                          chunk: Optional[int] = None, fused: bool = True) -> torch.Tensor:
    """mean_t CE(h_TD[t] @ w_VD.T, y_T[t]) over targets != IGNORE_INDEX, as
    `F.cross_entropy((h_TD @ w_VD.T).float(), y_T)` computes it, in chunks of `chunk` tokens (default: about
    CHUNK_BYTES of logit-sized buffers). The matmuls run in the autocast dtype when autocast is on, else in w_VD's
    dtype.
    fused: the softmax and gradient of each chunk in one Triton kernel on CUDA (model.cross_entropy_fusion)."""
    device_type = h_TD.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(h_TD.dtype, w_VD.dtype)
    want_grad = torch.is_grad_enabled() and (h_TD.requires_grad or w_VD.requires_grad)
    fused = fused and h_TD.is_cuda
    chunk = chunk or chunk_tokens(w_VD.shape[0], logit_bytes(compute_dtype, fused))
    return _ChunkedLinearCrossEntropy.apply(h_TD, w_VD, y_T, compute_dtype, chunk, want_grad, fused)
