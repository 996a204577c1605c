"""The FP8 layer on an sm90 GPU where its GEMMs present more rows than they have (OLMoE dims at 4k tokens: the down
and dh GEMMs run on producer buffers 4x longer), forward and backward against the same layer with the FP8 GEMMs
emulated in fp32. Run by test_fp8.py in a process without TRITON_INTERPRET; prints one line, exits non-zero on a
failure."""

from __future__ import annotations

import torch
import triton  # noqa: F401  (first: compiled mode)

from moe_launch.kernels import fp8
from moe_launch.kernels.moe import fast_experts


def main() -> None:
    torch.manual_seed(0)
    T, D, F, E, K = 4096, 2048, 1024, 64, 8
    assert fp8.rows_to_present(T * K, E, F, D) == 4 * T * K  # the case this checks
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randn(T, E, device="cuda").topk(K, -1).indices
    w = torch.rand(T, K, device="cuda", requires_grad=True)
    ws = [(0.02 * torch.randn(E, a, b, device="cuda")).bfloat16().requires_grad_() for a, b in ((F, D), (F, D), (D, F))]
    dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    outs = []
    for impl in ("torch", "reference"):  # torch: the CUTLASS GEMMs, which the presented rows are for
        for t in (x, w, *ws):
            t.grad = None
        y = fast_experts(x, idx, w, *ws, precision="fp8", gemm_impl=impl)
        y.backward(dy)
        outs.append([y.detach().float()] + [t.grad.float() for t in (x, w, *ws)])
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(*outs)]
    print("ok " if max(errs) < 2e-2 else "FAIL ", "rel err y, dx, dw_TK, dw_gate, dw_up, dw_down:",
          " ".join(f"{e:.1e}" for e in errs))
    if max(errs) >= 2e-2:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
