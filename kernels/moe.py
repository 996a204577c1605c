"""FastSparseMoE expert stage: route -> gather -> grouped SwiGLU experts -> weighted reduction, forward and backward.

Drop-in for trainer.moe.reference.experts_reference (same arguments, same result, same gradients):
  fast_experts(x_TD, idx_TK, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, e_start=0) -> y_TD
Shapes: T tokens, D model dim, F expert hidden, K top-k, E local experts [e_start, e_start+E), N = T*K row capacity.

Forward (Optimus Algorithm 1, stages 2-5; stage 1, communication, belongs to the EP dispatcher):
  plan = route_indices(idx_TK)                        counting + index generation, on the device
  x_ND = gather(x_TD)                                 expert-sorted rows
  g_NF = x_ND @ w_gate^T, u_NF = x_ND @ w_up^T         grouped GEMMs
  h_NF = silu(g) * u;  y_ND = h_NF @ w_down^T          fused SwiGLU, grouped GEMM
  y_TD = sum_k w_TK * y_ND[pair_row_TK]                output reduction
Saved for backward: x_ND, g_NF, u_NF, y_ND (h is recomputed inside the SwiGLU backward kernel).
Backward: reduction bwd (dy_ND, dw_TK) -> dh = dy_ND @ w_down -> SwiGLU bwd (dg, du, h) -> weight grads via
grouped_mm_wgrad -> dx_ND = dg @ w_gate and du @ w_up, summed per token by one reduction pass (no atomics).
Rows >= R of every buffer are unspecified and never read. No host sync anywhere on this path.
"""

from __future__ import annotations

import torch

from moe_launch.kernels.gather import gather_rows
from moe_launch.kernels.grouped_gemm import grouped_mm, grouped_mm_wgrad
from moe_launch.kernels.index_gen import RoutePlan, route_indices
from moe_launch.kernels.reduce import combine, combine_bwd
from moe_launch.kernels.swiglu import swiglu_bwd, swiglu_fwd


class _FastExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, idx_TK, e_start, gemm_impl):
        E = w_gate_EFD.shape[0]
        plan = route_indices(idx_TK, e_start, e_start + E)
        x_ND = gather_rows(x_TD.contiguous(), plan.row_token_N, plan.num_rows)
        g_NF = grouped_mm(x_ND, w_gate_EFD.transpose(1, 2), plan, gemm_impl)
        u_NF = grouped_mm(x_ND, w_up_EFD.transpose(1, 2), plan, gemm_impl)
        h_NF = swiglu_fwd(g_NF, u_NF, plan.num_rows)
        y_ND = grouped_mm(h_NF, w_down_EDF.transpose(1, 2), plan, gemm_impl)
        y_TD = combine(y_ND, plan.pair_row_TK, w_TK, out_dtype=x_TD.dtype)
        ctx.save_for_backward(x_ND, g_NF, u_NF, y_ND, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
        ctx.plan, ctx.gemm_impl, ctx.x_dtype = plan, gemm_impl, x_TD.dtype
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_ND, g_NF, u_NF, y_ND, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF = ctx.saved_tensors
        plan: RoutePlan = ctx.plan
        impl = ctx.gemm_impl
        dy_ND, dw_TK = combine_bwd(dy_TD.to(y_ND.dtype), y_ND, plan.pair_row_TK, w_TK)
        dh_NF = grouped_mm(dy_ND, w_down_EDF, plan, impl)
        dg_NF, du_NF, h_NF = swiglu_bwd(g_NF, u_NF, dh_NF, plan.num_rows)
        need = ctx.needs_input_grad
        dw_down = grouped_mm_wgrad(dy_ND, h_NF, plan, impl) if need[4] else None
        dw_gate = grouped_mm_wgrad(dg_NF, x_ND, plan, impl) if need[2] else None
        dw_up = grouped_mm_wgrad(du_NF, x_ND, plan, impl) if need[3] else None
        dx_TD = None
        if need[0]:
            dxg_ND = grouped_mm(dg_NF, w_gate_EFD, plan, impl)
            dxu_ND = grouped_mm(du_NF, w_up_EFD, plan, impl)
            dx_TD = combine(dxg_ND, plan.pair_row_TK, None, rows2_ND=dxu_ND, out_dtype=ctx.x_dtype)
        return dx_TD, (dw_TK if need[1] else None), dw_gate, dw_up, dw_down, None, None, None


def fast_experts(
    x_TD: torch.Tensor,
    idx_TK: torch.Tensor,
    w_TK: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    e_start: int = 0,
    gemm_impl: str = "auto",
) -> torch.Tensor:
    """Same contract as trainer.moe.reference.experts_reference: y[t] = sum over local k of w[t,k] * expert(x[t]).

    gemm_impl: "auto" (torch grouped_mm on sm90 bf16, else our Triton kernel), "torch", "triton" or "reference".
    Under torch.autocast the expert computation runs in the autocast dtype, as F.linear would, and y_TD comes back in
    that dtype; the casts sit outside the autograd Function, so fp32 master weights get fp32 gradients. w_TK keeps
    its dtype (the reductions accumulate in fp32 either way).
    """
    dev = x_TD.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x_TD, w_gate_EFD, w_up_EFD, w_down_EDF = (t.to(dt) for t in (x_TD, w_gate_EFD, w_up_EFD, w_down_EDF))
    return _FastExperts.apply(x_TD, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, idx_TK, int(e_start), gemm_impl)
