"""FastSparseMoE kernels: token counting, index generation, gather, grouped GEMM, output reduction.

Entry points (each stage file holds the Triton path, a plain-torch reference, and one function that chooses):
  moe.fast_experts(x_TD, idx_TK, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, e_start=0, precision="bf16") -> y_TD
      drop-in for trainer.moe.reference.experts_reference (forward and autograd), what model.moe.impl=fast selects;
      precision="fp8" (model.moe.precision) runs the forward and activation-gradient GEMMs in FP8 (fp8.py)
  index_gen.route_indices(idx_TK, e_start, e_end) -> RoutePlan     stages 1+2 (token_count.py, index_gen.py)
  gather.gather_rows(x_TD, plan.row_token_N, plan.num_rows) -> x_ND
  grouped_gemm.grouped_mm(a_NK, b_EKM, plan) / grouped_mm_wgrad(a_NM, b_NK, plan)
  swiglu.swiglu_fwd / swiglu_bwd(..., routing=(w_TK, plan.row_pair_N))   the latter also the routing weights' grad
  fp8.quantize_rows / scaled_grouped_mm       e4m3 with per-row / per-channel scales, torch._scaled_grouped_mm
  reduce.combine(rows_ND, plan.pair_row_TK, w_TK) -> y_TD
  cross_entropy.softmax_xent_(logits_CV, y_C, ignore_index, write_grad) -> loss_C
      the output head's per-chunk softmax, loss and logit gradient (trainer/model/loss.py, model.cross_entropy_fusion)
  norm_rope.norm_rope(x_BSD, w_D, eps, cos_SDh, sin_signed_SDh) -> y_BSD
      QK-norm and RoPE of one attention projection, forward and backward (trainer/model/attention.py,
      model.qk_norm_rope_fusion)
An expert-parallel dispatcher can run route_indices on the tokens it received (all-gathered or all-to-all'd) with
its own [e_start, e_end) and call fast_experts on them: pairs routed elsewhere contribute nothing.

Triton decides once, when `triton` is first imported, whether `@triton.jit` compiles or interprets (it reads
TRITON_INTERPRET then; the standard library's own jit functions such as tl.sum are decorated at that moment). On a
host without a CUDA device compiled kernels cannot run at all, so if triton is not imported yet we ask for the
interpreter before the kernel modules import it. On a GPU host nothing is changed. interpreter_check.py says whether
the interpreter runs under this environment's numpy (Triton < 3.7 does not under numpy >= 2.4).
"""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
