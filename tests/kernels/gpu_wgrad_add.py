"""The accumulating weight-gradient GEMM compiled on an sm90 GPU (TMA reads, epilogue add) against old + the fp32
product: ragged experts, experts without rows (left exactly as they were), sizes that are not tile multiples. Run by
test_grad_fusion.py in a process without TRITON_INTERPRET; prints one line per case, exits non-zero on a failure."""

from __future__ import annotations

import torch
import triton  # noqa: F401  (first: compiled mode)
from kernel_helpers import random_idx, rel_err

from moe_launch.kernels import grouped_gemm
from moe_launch.kernels.index_gen import route_indices


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for T, K, E, M, Kc, skip in ((4096, 8, 64, 1024, 2048, range(0)), (1000, 4, 64, 256, 512, range(10, 30)),
                                 (333, 2, 8, 200, 136, range(0))):
        plan = route_indices(random_idx(T, K, E, gen, skip).cuda(), 0, E)
        a_NM = torch.randn(T * K, M, generator=gen).cuda().bfloat16()
        b_NK = torch.randn(T * K, Kc, generator=gen).cuda().bfloat16()
        assert grouped_gemm.tma_ok(a_NM, b_NK)
        old = torch.randn(E, M, Kc, generator=gen).cuda().bfloat16()
        out = old.clone()
        grouped_gemm.grouped_mm_wgrad_add_(out, a_NM, b_NK, plan)
        want = old.float() + grouped_gemm.grouped_mm_wgrad_reference(a_NM.float(), b_NK.float(), plan.offsets_E1)
        err = rel_err(out.float(), want)
        assert err <= 1e-2, (T, K, E, M, Kc, err)
        assert torch.equal(out[skip.start:skip.stop], old[skip.start:skip.stop])
        print(f"ok T {T} K {K} E {E} M {M} K' {Kc}: rel err {err:.1e}")


if __name__ == "__main__":
    main()
