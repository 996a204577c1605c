"""The compiled QK-norm + RoPE kernel (kernels/norm_rope.py) at OLMoE's attention shape (4 x 4096 tokens, 16 heads of
128) in bf16, against the model's path run in fp64 as the truth: the kernel's output and gradients must be at least
as close to it as the model's own bf16 path (RMSNorm, apply_rotary). Cases: a contiguous projection, a slice of a
fused q|k|v projection, and the op inside an Inductor-compiled function. Then the model with `train.compile` on both
settings of model.qk_norm_rope_fusion: the same loss and gradients within bf16 rounding, and no graph break. Run by
test_norm_rope.py in a process without TRITON_INTERPRET; prints one line per case, exits non-zero on a failure."""

from __future__ import annotations

import torch
import triton  # noqa: F401  (first: compiled mode)
from kernel_helpers import rel_err

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.kernels.norm_rope import norm_rope
from moe_launch.trainer.compile import compile_model
from moe_launch.trainer.dtypes import cast_parameters
from moe_launch.trainer.model import build_model
from moe_launch.trainer.model.norm import RMSNorm
from moe_launch.trainer.model.rope import Rotary, apply_rotary


def _model_path(x_BSD, w_D, eps, cos_SDh, sin_SDh):
    B, S, D = x_BSD.shape
    Dh = cos_SDh.shape[-1]
    y_BSD = torch.func.functional_call(RMSNorm(D, eps).to(x_BSD.device), {"weight": w_D}, (x_BSD,))
    y_BHSDh = apply_rotary(y_BSD.view(B, S, D // Dh, Dh).transpose(1, 2), cos_SDh, sin_SDh)
    return y_BHSDh.transpose(1, 2).reshape(B, S, D)


def _grads(fn, x_BSD, w_D, g_BSD):
    x, w = x_BSD.detach().clone().requires_grad_(), w_D.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(g_BSD)
    return y.detach(), x.grad, w.grad


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    B, S, H, Dh, eps = 4, 4096, 16, 128, 1e-5
    D = H * Dh
    rotary = Rotary(Dh, S, 10000.0).cuda()
    cos, sin = rotary.cos_SDh, rotary.sin_signed_SDh
    qkv_BS3D = (torch.randn(B, S, 3 * D, generator=gen) * 2).cuda().bfloat16()
    w_D = (1 + 0.2 * torch.randn(D, generator=gen)).cuda().bfloat16()
    g_BSD = torch.randn(B, S, D, generator=gen).cuda().bfloat16()
    compiled = torch.compile(lambda x, w: norm_rope(x, w, eps, cos, sin))
    for name, x_BSD, fn in (("contiguous", qkv_BS3D[..., :D].contiguous(), None),
                            ("slice of q|k|v", qkv_BS3D[..., D:2 * D], None),
                            ("inductor-compiled", qkv_BS3D[..., :D].contiguous(), compiled)):
        truth = _grads(lambda x, w: _model_path(x, w, eps, cos.double(), sin.double()),
                       x_BSD.double(), w_D.double(), g_BSD.double())
        bf16 = _grads(lambda x, w: _model_path(x, w, eps, cos, sin), x_BSD, w_D, g_BSD)
        got = _grads(fn or (lambda x, w: norm_rope(x, w, eps, cos, sin)), x_BSD, w_D, g_BSD)
        errs = [(rel_err(g, t), rel_err(b, t)) for g, b, t in zip(got, bf16, truth)]
        # the weight gradient sums 16k rows: allow the kernel's fp32 order to differ from the model path's
        assert all(e <= 1.05 * r + 1e-6 for e, r in errs[:2]) and errs[2][0] <= 2 * errs[2][1] + 1e-5, (name, errs)
        print(f"ok {name}: rel err vs fp64 (kernel / model path in bf16) y {errs[0][0]:.1e} / {errs[0][1]:.1e}, "
              f"dx {errs[1][0]:.1e} / {errs[1][1]:.1e}, dw {errs[2][0]:.1e} / {errs[2][1]:.1e}")

    _model_with_and_without_fusion()


def _model_with_and_without_fusion() -> None:
    from torch._dynamo.utils import counters

    tokens_BS = torch.randint(0, 1000, (2, 513), generator=torch.Generator().manual_seed(1)).cuda()
    runs = []
    for fusion in (False, True):
        cfg = ModelConfig(name="t", kind="moe", vocab_size=1000, d_model=256, n_layers=2, n_heads=2, max_seq_len=512,
                          qk_norm_rope_fusion=fusion, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=128))
        torch.manual_seed(0)
        model = build_model(cfg).cuda()
        cast_parameters(model, torch.bfloat16)  # as the trainer does: the rotary tables stay fp32
        compile_model(model)
        counters.clear()
        loss, _ = model.compute_loss(tokens_BS[:, :-1], tokens_BS[:, 1:])
        loss.backward()
        assert not counters["graph_break"], dict(counters["graph_break"])
        runs.append((loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (loss0, g0), (loss1, g1) = runs
    errs = {n: rel_err(g1[n], g0[n]) for n in g0}
    worst = max(errs, key=errs.get)
    assert abs(loss1 - loss0) <= 1e-2 * abs(loss0) and errs[worst] <= 3e-2, (float(loss0), float(loss1), worst, errs)
    print(f"ok model compiled, fusion on vs off: loss {float(loss1):.4f} / {float(loss0):.4f}, worst gradient "
          f"rel err {errs[worst]:.1e} ({worst})")


if __name__ == "__main__":
    main()
