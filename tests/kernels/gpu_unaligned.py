"""Sizes that break CUTLASS's 16-byte rule on the GPU: a model dim of 204 and an expert hidden size of 100 (408- and
200-byte bf16 rows). The layer runs (Triton's grouped GEMM takes those operands) and its output and every gradient
match the reference; aligned sizes keep the CUTLASS path on sm90. Run by test_kernels.py in a process without
TRITON_INTERPRET; prints "ok unaligned", exits non-zero on a failure."""

from __future__ import annotations

import torch
import triton  # noqa: F401  (first: compiled mode)

from moe_launch.kernels import grouped_gemm
from moe_launch.kernels.moe import fast_experts
from moe_launch.trainer.moe.reference import experts_reference


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    T, D, Fh, E, K = 512, 204, 100, 8, 2
    ts = [torch.randn(T, D, generator=g), torch.rand(T, K, generator=g), torch.randn(E, Fh, D, generator=g) / 8,
          torch.randn(E, Fh, D, generator=g) / 8, torch.randn(E, D, Fh, generator=g) / 6]
    idx_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
    dy_TD = torch.randn(T, D, generator=g).cuda().bfloat16()

    def run(fn):
        ps = [t.cuda().bfloat16().requires_grad_() for t in ts]
        y = fn(ps[0], idx_TK, ps[1], *ps[2:])
        return [y, *torch.autograd.grad(y, ps, dy_TD)]

    for name, a, b in zip(("y", "dx", "dw_TK", "dw_gate", "dw_up", "dw_down"), run(fast_experts),
                          run(experts_reference)):
        assert rel(a, b) < 1e-2, (name, rel(a, b))
    assert grouped_gemm.pick("auto", ts[2].cuda().bfloat16()) == "triton"
    if torch.cuda.get_device_capability()[0] >= 9:
        assert grouped_gemm.pick("auto", torch.zeros(E, 16, 24, device="cuda", dtype=torch.bfloat16)) == "torch"
    print("ok unaligned")


if __name__ == "__main__":
    main()
