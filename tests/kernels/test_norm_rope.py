"""The fused QK-norm + RoPE kernel (kernels/norm_rope.py, interpreted here) against the model's own path (RMSNorm,
then apply_rotary): output, input gradient and weight gradient, for random inputs in fp32 and bf16, rows that do not
fill a tile or a program's strip, a strided input (a slice of a wider projection), positions restarting per
sequence, torch.compile keeping the op whole, and the setting reaching the model. The compiled kernel at OLMoE's
shape, and the compiled model with and without it: gpu_norm_rope.py on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers_gpu import host_has_gpu
from kernel_helpers import input_generator, rel_err, run_compiled

from moe_launch.conf.schema import ModelConfig
from moe_launch.kernels.norm_rope import norm_rope
from moe_launch.trainer.model import build_model
from moe_launch.trainer.model.norm import RMSNorm
from moe_launch.trainer.model.rope import Rotary, apply_rotary


def _reference(x_BSD, w_D, eps, rotary):
    B, S, D = x_BSD.shape
    Dh = rotary.cos_SDh.shape[-1]
    y_BSD = torch.func.functional_call(RMSNorm(D, eps), {"weight": w_D}, (x_BSD,))
    y_BHSDh = apply_rotary(y_BSD.view(B, S, D // Dh, Dh).transpose(1, 2), rotary.cos_SDh, rotary.sin_signed_SDh)
    return y_BHSDh.transpose(1, 2).reshape(B, S, D)


def _case(B, S, H, Dh, dtype, width=None):
    gen = input_generator()
    D = H * Dh
    wide_BSW = torch.randn(B, S, width or D, generator=gen).to(dtype) * 3
    x_BSD = wide_BSW[..., :D] if width else wide_BSW
    w_D = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype)
    g_BSD = torch.randn(B, S, D, generator=gen).to(dtype)
    return x_BSD, w_D, g_BSD, Rotary(Dh, max_seq_len=S + 5, theta=10000.0)


def _grads(fn, x_BSD, w_D, g_BSD):
    x, w = x_BSD.detach().clone().requires_grad_(), w_D.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(g_BSD)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the last: OLMoE's row (2 rows per tile), 4 programs of 20 rows on the CPU, the last one's strip ending mid-tile
@pytest.mark.parametrize("B, S, H, Dh, width", [(2, 7, 4, 16, None), (1, 33, 3, 8, None), (3, 5, 2, 32, 160),
                                                (1, 1, 1, 2, None), (1, 75, 16, 128, None)])
def test_output_and_gradients_equal_the_model_path(B, S, H, Dh, width, dtype):
    x_BSD, w_D, g_BSD, rotary = _case(B, S, H, Dh, dtype, width)
    eps = 1e-5
    S_ = x_BSD.shape[1]
    want = _grads(lambda x, w: _reference(x, w, eps, rotary), x_BSD, w_D, g_BSD)
    got = _grads(lambda x, w: norm_rope(x, w, eps, rotary.cos_SDh[:S_], rotary.sin_signed_SDh[:S_]), x_BSD, w_D, g_BSD)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == dtype
    assert got[0].is_contiguous() and got[0].shape == x_BSD.shape
    # fp32: the same math in another order; bf16: the reference rounds the normalised row to bf16 before rotating,
    # the kernel once at the end, so outputs differ by about one bf16 unit
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert rel_err(a.float(), b.float()) <= tol, (name, rel_err(a.float(), b.float()))


def test_positions_restart_with_each_sequence():
    """Row n of the flattened [B * S] tokens is at position n % S: two sequences holding the same tokens give the
    same output rows."""
    x_BSD, w_D, _, rotary = _case(1, 6, 2, 8, torch.float32)
    x2_BSD = torch.cat([x_BSD, x_BSD])
    y2_BSD = norm_rope(x2_BSD, w_D, 1e-5, rotary.cos_SDh[:6], rotary.sin_signed_SDh[:6])
    assert torch.equal(y2_BSD[0], y2_BSD[1])
    assert not torch.allclose(y2_BSD[0, 1:], y2_BSD[0, :-1])  # positions differ within a sequence


def test_compile_keeps_the_op_whole():
    """Under torch.compile the custom op is one opaque call forward and backward: the compiled function gives the
    eager op's values and gradients."""
    x_BSD, w_D, g_BSD, rotary = _case(2, 4, 2, 8, torch.float32)
    cos, sin = rotary.cos_SDh[:4], rotary.sin_signed_SDh[:4]

    def f(x, w):
        return norm_rope(x * 2, w, 1e-5, cos, sin) + 1

    eager = _grads(f, x_BSD, w_D, g_BSD)
    compiled = _grads(torch.compile(f, backend="aot_eager", fullgraph=True), x_BSD, w_D, g_BSD)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fusion, qk_norm", [(True, True), (False, True), (True, False)])
def test_the_setting_reaches_attention(fusion, qk_norm):
    """model.qk_norm_rope_fusion selects the kernel in every block (on CUDA); without QK-norm there is nothing to
    fuse."""
    cfg = ModelConfig(name="t", kind="dense", vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=8,
                      ffn_hidden=48, qk_norm=qk_norm, qk_norm_rope_fusion=fusion)
    assert [b.attn.fuse_norm_rope for b in build_model(cfg).blocks] == [fusion and qk_norm] * 2


def test_odd_head_dim_is_refused():
    x_BSD = torch.randn(1, 2, 6)
    cos = torch.ones(2, 3)
    with pytest.raises(ValueError, match="odd"):
        norm_rope(x_BSD, torch.ones(6), 1e-5, cos, cos)


@pytest.mark.skipif(not host_has_gpu(), reason="needs a CUDA GPU (the compiled kernel)")
def test_compiled_kernel_on_the_gpu():
    """gpu_norm_rope.py in a process without TRITON_INTERPRET (this folder's tests interpret Triton)."""
    out = run_compiled("gpu_norm_rope.py")
    assert out.count("ok ") == 4, out
