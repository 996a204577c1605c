"""The router's fp32 logits from bf16 operands (trainer/moe/router.py router_logits): the forward is the fp32 GEMM of
the same values, the backward two bf16 GEMMs whose results match fp32's to bf16 rounding."""

import torch

from moe_launch.trainer.moe import router as router_mod
from moe_launch.trainer.moe.router import router_logits


def _operands(T=64, D=96, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16().requires_grad_()
    w = (0.1 * torch.randn(E, D, generator=g)).bfloat16().requires_grad_()
    return x, w


def test_forward_equals_the_fp32_gemm_of_the_same_values():
    x, w = _operands()
    logits = router_logits(x, w)
    ref = torch.nn.functional.linear(x.detach().float(), w.detach().float())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, rtol=1e-6, atol=1e-6)


def test_backward_matches_fp32_to_bf16_rounding_and_keeps_dtypes():
    x, w = _operands(seed=1)
    g = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    router_logits(x, w).backward(g)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    torch.nn.functional.linear(x32, w32).backward(g)
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    for ours, ref in ((x.grad, x32.grad), (w.grad, w32.grad)):
        err = (ours.float() - ref).norm() / ref.norm()
        assert err < 1e-2, err


def test_other_dtypes_take_the_fp32_gemm(monkeypatch):
    calls = []
    monkeypatch.setattr(router_mod._Bf16Logits, "apply", lambda *a: calls.append(a))
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
    logits = router_logits(x, w)
    assert calls == [] and logits.dtype == torch.float32
    router_logits(x.detach().bfloat16(), w.detach().bfloat16(), gemm="fp32")
    assert calls == []
    router_logits(x.detach().bfloat16(), w.detach().bfloat16())
    assert len(calls) == 1


def test_autocast_does_not_lower_the_logits():
    x, w = _operands(seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router_logits(x.detach().float(), w.detach().float())
    assert logits.dtype == torch.float32
