"""The fused softmax cross-entropy kernel (kernels/cross_entropy.py, interpreted here) against its torch reference
(trainer/model/loss.py softmax_xent_torch): per-token loss and the gradient written over the logits, for rows longer
than one block with ragged tails, ignored targets, logits far from zero, bf16 and fp32; without the gradient the
logits stay as they were. The compiled kernel through the whole chunked head: gpu_cross_entropy.py on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers_gpu import host_has_gpu
from kernel_helpers import run_compiled

from moe_launch.kernels.cross_entropy import softmax_xent_
from moe_launch.trainer.model.loss import IGNORE_INDEX, softmax_xent_torch


def _logits(C: int, V: int, dtype: torch.dtype, seed: int, offset: float = 0.0, spread: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(C, V, generator=g) * spread + offset).to(dtype), torch.randint(0, V, (C,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C, V", [(5, 2500), (3, 1024), (7, 33), (1, 1)])
def test_loss_and_gradient_equal_the_reference(C, V, dtype):
    logits_CV, y_C = _logits(C, V, dtype, seed=C * V)
    y_C[::3] = IGNORE_INDEX
    want_loss, want_g = softmax_xent_torch(logits_CV, y_C, write_grad=True)
    got = logits_CV.clone()
    loss_C = softmax_xent_(got, y_C, IGNORE_INDEX, write_grad=True)
    assert loss_C.dtype == torch.float32 and got.dtype == dtype
    torch.testing.assert_close(loss_C, want_loss, rtol=1e-5, atol=1e-5)
    assert torch.all(loss_C[::3] == 0)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want_g, rtol=1e-5, atol=1e-6)
    else:  # the same fp32 value rounded to bf16, up to one unit in the last place where fp32 rounding differs
        torch.testing.assert_close(got.float(), want_g.float(), rtol=8e-3, atol=1e-6)
    # each valid row's gradient sums to 0 (softmax sums to 1, minus the onehot), an ignored row's to 1
    sums_C = got.double().sum(1)
    valid_C = y_C != IGNORE_INDEX
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(sums_C[valid_C], torch.zeros_like(sums_C[valid_C]), rtol=0, atol=tol)
    torch.testing.assert_close(sums_C[~valid_C], torch.ones_like(sums_C[~valid_C]), rtol=0, atol=tol)


def test_logits_far_from_zero_stay_finite():
    """The online max keeps exp in range: logits around +-3000 (exp overflows fp32 past 88)."""
    for offset in (3000.0, -3000.0):
        logits_CV, y_C = _logits(4, 3000, torch.float32, seed=1, offset=offset, spread=40.0)
        want_loss, want_g = softmax_xent_torch(logits_CV, y_C, write_grad=True)
        got = logits_CV.clone()
        loss_C = softmax_xent_(got, y_C, IGNORE_INDEX, write_grad=True)
        assert torch.isfinite(loss_C).all() and torch.isfinite(got).all()
        torch.testing.assert_close(loss_C, want_loss, rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(got, want_g, rtol=1e-4, atol=1e-6)


def test_without_gradient_the_logits_are_untouched():
    logits_CV, y_C = _logits(6, 1500, torch.bfloat16, seed=2)
    kept = logits_CV.clone()
    loss_C = softmax_xent_(logits_CV, y_C, IGNORE_INDEX, write_grad=False)
    assert torch.equal(logits_CV, kept)
    torch.testing.assert_close(loss_C, softmax_xent_torch(kept, y_C, write_grad=False)[0], rtol=1e-5, atol=1e-5)


def test_rows_must_be_contiguous():
    logits_VC, y_C = _logits(8, 4, torch.float32, seed=3)
    with pytest.raises(ValueError, match="contiguous"):
        softmax_xent_(logits_VC.t(), y_C[:4], IGNORE_INDEX, write_grad=True)


@pytest.mark.skipif(not host_has_gpu(), reason="needs a CUDA GPU (the compiled kernel)")
def test_compiled_kernel_in_the_chunked_head_on_the_gpu():
    """gpu_cross_entropy.py in a process without TRITON_INTERPRET (this folder's tests interpret Triton)."""
    out = run_compiled("gpu_cross_entropy.py")
    assert out.count("ok ") == 4, out
