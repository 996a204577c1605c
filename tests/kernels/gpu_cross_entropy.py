"""The chunked output head + cross-entropy with the compiled fused kernel (model.cross_entropy_fusion) against the
torch path, on a GPU in bf16 at the OLMoE vocabulary: loss, dh and dW, ignored targets, a ragged last chunk. Run by
test_cross_entropy.py in a process without TRITON_INTERPRET; prints one line per case, exits non-zero on a failure."""

from __future__ import annotations

import torch
import triton  # noqa: F401  (first: compiled mode)
from kernel_helpers import rel_err

from moe_launch.trainer.model.loss import IGNORE_INDEX, chunked_cross_entropy


def _run(h_TD, w_VD, y_T, chunk, fused):
    h, w = h_TD.clone().requires_grad_(), w_VD.clone().requires_grad_()
    loss = chunked_cross_entropy(h, w, y_T, chunk=chunk, fused=fused)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    # chunk None: each path's default, the fused one 4x longer (one full chunk and a ragged one here)
    for T, D, V, chunk in ((4096, 2048, 50304, 1280), (1000, 256, 50304, 384), (333, 64, 1000, 128),
                           (12000, 256, 50304, None)):
        h_TD = torch.randn(T, D, generator=gen).cuda().bfloat16()
        w_VD = (torch.randn(V, D, generator=gen) * D ** -0.5).cuda().bfloat16()
        y_T = torch.randint(0, V, (T,), generator=gen).cuda()
        y_T[::7] = IGNORE_INDEX
        want, got = _run(h_TD, w_VD, y_T, chunk, fused=False), _run(h_TD, w_VD, y_T, chunk, fused=True)
        errs = [rel_err(g.float(), w.float()) for g, w in zip(got, want)]
        # the same chunks sum the loss in the same order; different chunks only reorder fp32 sums
        assert errs[0] <= (1e-6 if chunk else 1e-5) and max(errs[1:]) <= 1e-2, (T, D, V, chunk, errs)
        print(f"ok T {T} D {D} V {V} chunk {chunk}: loss {float(got[0]):.5f} rel err loss {errs[0]:.1e} "
              f"dh {errs[1]:.1e} dW {errs[2]:.1e}")


if __name__ == "__main__":
    main()
