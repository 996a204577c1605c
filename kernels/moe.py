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
Saved for backward: x_ND, g_NF, u_NF (h is recomputed inside the SwiGLU backward kernel, y_ND is not kept); with
FP8 x_TD in place of x_ND, which then only feeds the weight gradients and is gathered in the backward (T rows kept,
not T*K).
Backward: dy_ND = gather(dy_TD) (rows before their routing weight) -> dh' = dy_ND @ w_down -> SwiGLU bwd with w:
dg, du of w*dh', w*h, and dw_TK = <h, dh'> (= <y_ND row, dy>, so y_ND need not be saved) -> weight grads via
grouped_mm_wgrad (w_down's from dy_ND and w*h) -> dx_ND = dg @ w_gate and du @ w_up, summed per token by one
reduction pass (no atomics).
Rows >= R of every buffer are unspecified and never read. No host sync anywhere on this path.
bf16 on Hopper where kernels/swiglu_gemm.py fused_path says so: gate and up as one pass over x_ND with SwiGLU in its
epilogue (g, u, h written), and dx as dg @ w_gate + du @ w_up in one accumulator (one row set to combine); the other
GEMMs and stages as above.

precision="fp8" (kernels/fp8.py): the forward GEMMs (gate and up as one, down) and the activation-gradient GEMMs
(dh; dx as one GEMM over [dg du] with K = 2F) run as e4m3 x e4m3 grouped GEMMs with fp32 accumulation and bf16
output: torch._scaled_grouped_mm, or per shape our TMA kernel (kernels/grouped_gemm_tma.py). Activations are scaled
per row, weights per output channel; the weights' operands come from kernels/fp8_weights.py, quantized in every call
or once per reuse_weights() scope (master weights and optimizer untouched). Activations are quantized at token
granularity where the rows are copies of a token: x_TD and dy_TD are quantized (T rows, not T*K) and their e4m3 rows
gathered like x_ND (dy's rows carry no routing weight: the SwiGLU backward applies it). h and
the rows of [dg du] (one scale per row over both) are quantized by the SwiGLU kernels themselves (kernels/swiglu.py;
h is then never written in bf16). The three weight-gradient GEMMs stay bf16: torch's FP8 2d x 2d grouped GEMM takes
K = tokens, which needs every expert's row group 16-aligned (padding the plan) and each of dy, h, dg, du, x
quantized again per expert column, a cost about equal to what FP8 would save there (benchmarks/RESULTS.md, "FP8
experts"). Saved for backward as in the bf16 path (g and u as the two halves of the gate-up GEMM's output) but x_TD
for x_ND, so no [T*K, D] buffer is kept; outputs come back in bf16, gradients in their inputs' dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe_launch.conf.schema import FP8_DIM_MULTIPLE
from moe_launch.kernels import fp8
from moe_launch.kernels import grouped_gemm_tma as tma
from moe_launch.kernels.fp8_weights import ExpertOperands, Operand
from moe_launch.kernels.gather import gather_rows
from moe_launch.kernels.grouped_gemm import grouped_mm, grouped_mm_wgrad, grouped_mm_wgrad_add_
from moe_launch.kernels.index_gen import RoutePlan, route_indices
from moe_launch.kernels.reduce import combine
from moe_launch.kernels.swiglu import swiglu_bwd, swiglu_bwd_fp8, swiglu_fwd, swiglu_fwd_fp8
from moe_launch.kernels.swiglu_gemm import dual_mm, fused_path, swiglu_up

if TYPE_CHECKING:
    from moe_launch.kernels.moe_graph import ExpertGraphs

PRECISIONS = ("bf16", "fp8")


@dataclass
class ExpertsSaved:
    """What the backward of one expert-stage call needs: its saved tensors (x_ND, or x_TD with FP8; g_NF, u_NF, w_TK;
    the bf16 weights, or none with FP8, whose operands hold them) and the plan and operands they go with."""
    tensors: tuple[torch.Tensor, ...]
    plan: RoutePlan
    gemm_impl: str
    x_dtype: torch.dtype
    ops: ExpertOperands | None
    fused: bool = False  # bf16 on the fused SwiGLU GEMMs (kernels/swiglu_gemm.py)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ops = self.ops
        return (ops.w_gate_EFD, ops.w_up_EFD, ops.w_down_EDF) if ops is not None else self.tensors[4:7]


def experts_forward(x_TD, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, idx_TK, e_start: int, gemm_impl: str,
                    precision: str) -> tuple[torch.Tensor, ExpertsSaved]:
    """The expert stage's forward outside autograd: y_TD and what its backward needs. No host sync."""
    E = w_gate_EFD.shape[0]
    plan = route_indices(idx_TK, e_start, e_start + E)
    x_TD = x_TD.contiguous()
    ops, fused = None, False
    if precision == "fp8":
        ops, mm = ExpertOperands(w_gate_EFD, w_up_EFD, w_down_EDF), _Fp8Gemms(plan, gemm_impl)
        Fh = w_gate_EFD.shape[1]
        gu_N2F = mm(*mm.gathered_rows(x_TD), ops.gate_up())  # one GEMM for both projections
        g_NF, u_NF = gu_N2F[:, :Fh], gu_N2F[:, Fh:]
        hq_ND, hs_N = swiglu_fwd_fp8(g_NF, u_NF, plan.num_rows, capacity=mm.presented(Fh, x_TD.shape[1]))
        y_ND = mm(hq_ND, hs_N, ops.down(), saved=False)  # h itself is never written
        x_saved = x_TD  # the bf16 rows only feed the weight gradients: gathered in the backward
    else:
        x_ND = x_saved = gather_rows(x_TD, plan.row_token_N, plan.num_rows)
        fused = fused_path(gemm_impl, x_ND, w_gate_EFD, w_up_EFD)
        if fused:  # one pass over x_ND for both projections, SwiGLU in the epilogue
            g_NF, u_NF, h_NF = swiglu_up(x_ND, w_gate_EFD.transpose(1, 2), w_up_EFD.transpose(1, 2), plan.counts_E,
                                         plan.offsets_E1)
        else:
            g_NF = grouped_mm(x_ND, w_gate_EFD.transpose(1, 2), plan, gemm_impl)
            u_NF = grouped_mm(x_ND, w_up_EFD.transpose(1, 2), plan, gemm_impl)
            h_NF = swiglu_fwd(g_NF, u_NF, plan.num_rows)
        y_ND = grouped_mm(h_NF, w_down_EDF.transpose(1, 2), plan, gemm_impl)
    y_TD = combine(y_ND, plan.pair_row_TK, w_TK, out_dtype=x_TD.dtype)
    weights = () if ops is not None else (w_gate_EFD, w_up_EFD, w_down_EDF)  # fp8: the operands hold them
    return y_TD, ExpertsSaved((x_saved, g_NF, u_NF, w_TK, *weights), plan, gemm_impl, x_TD.dtype, ops,
                              fused=fused)


def experts_backward(saved: ExpertsSaved, dy_TD: torch.Tensor, need: tuple[bool, ...],
                     into: tuple[torch.Tensor | None, ...]):
    """The expert stage's backward outside autograd -> (dx_TD, dw_TK, dw_gate, dw_up, dw_down), None where `need`
    (needs_input_grad of (x, w_TK, w_gate, w_up, w_down)) is false or the gradient went into `into` (each weight's
    gradient buffer, or None to return it)."""
    x_saved, g_NF, u_NF, w_TK = saved.tensors[:4]
    plan, impl, ops = saved.plan, saved.gemm_impl, saved.ops
    fp8_mm = _Fp8Gemms(plan, impl) if ops is not None else None
    w_gate_EFD, w_up_EFD, w_down_EDF = w_EMK = saved.weights()
    dy_TD = dy_TD.to(g_NF.dtype).contiguous()
    # the rows' gradient before their routing weight: the SwiGLU backward applies w and takes w's gradient from h
    dy_ND = None
    if fp8_mm is None or need[4]:
        dy_ND = gather_rows(dy_TD, plan.row_token_N, plan.num_rows)
    if fp8_mm is not None:
        rows = fp8_mm.presented(dy_TD.shape[1], g_NF.shape[1])
        dh_NF = fp8_mm(*fp8_mm.gathered_rows(dy_TD, rows), ops.down_t(), saved=False)
    else:
        dh_NF = grouped_mm(dy_ND, w_down_EDF, plan, impl)
    x_ND = x_saved
    if ops is not None and (need[2] or need[3]):  # fp8 saved x_TD: the rows the weight gradients take
        x_ND = gather_rows(x_saved, plan.row_token_N, plan.num_rows)
    routing = (w_TK, plan.row_pair_N)
    if fp8_mm is not None and need[0]:  # with the e4m3 rows of [dg du] for the input gradient
        dg_NF, du_NF, wh_NF, dw_TK, dguq_N2F, dgus_N = swiglu_bwd_fp8(g_NF, u_NF, dh_NF, plan.num_rows, routing)
    else:
        dg_NF, du_NF, wh_NF, dw_TK = swiglu_bwd(g_NF, u_NF, dh_NF, plan.num_rows, routing=routing)
    dw_down = weight_grad(dy_ND, wh_NF, plan, impl, need[4], into[2])  # sum_r dy[t(r)] (w_r h_r)^T
    dw_gate = weight_grad(dg_NF, x_ND, plan, impl, need[2], into[0])
    dw_up = weight_grad(du_NF, x_ND, plan, impl, need[3], into[1])
    dx_TD = None
    if need[0]:
        if fp8_mm is not None:  # [dg du] @ [w_gate; w_up]: one GEMM (K = 2F), one row set to combine
            dx_ND = fp8_mm(dguq_N2F, dgus_N, ops.gate_up_t(), saved=False)
            dx_TD = combine(dx_ND, plan.pair_row_TK, None, out_dtype=saved.x_dtype)
        elif saved.fused:  # dg @ w_gate + du @ w_up in one accumulator: no concatenated weights, one row set
            dx_ND = dual_mm(dg_NF, w_gate_EFD, du_NF, w_up_EFD, plan.counts_E, plan.offsets_E1)
            dx_TD = combine(dx_ND, plan.pair_row_TK, None, out_dtype=saved.x_dtype)
        else:
            dxg_ND = grouped_mm(dg_NF, w_gate_EFD, plan, impl)
            dxu_ND = grouped_mm(du_NF, w_up_EFD, plan, impl)
            dx_TD = combine(dxg_ND, plan.pair_row_TK, None, rows2_ND=dxu_ND, out_dtype=saved.x_dtype)
    if ops is not None:  # fp8 takes the weights in their own dtype; the weight-gradient GEMMs run in bf16
        dw_gate, dw_up, dw_down = (None if d is None else d.to(w.dtype) for d, w in
                                   ((dw_gate, w_EMK[0]), (dw_up, w_EMK[1]), (dw_down, w_EMK[2])))
    return dx_TD, (dw_TK if need[1] else None), dw_gate, dw_up, dw_down


def grad_buffers(weights, fuse: bool) -> tuple[torch.Tensor | None, ...]:
    return tuple(grad_buffer(w) if fuse else None for w in weights)


class _FastExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, idx_TK, e_start, gemm_impl, precision,
                fuse_grads):
        y_TD, saved = experts_forward(x_TD, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, idx_TK, e_start, gemm_impl,
                                      precision)
        ctx.save_for_backward(*saved.tensors)  # through autograd: saved-tensor hooks and version checks see them
        saved.tensors = ()
        ctx.saved, ctx.fuse_grads = saved, fuse_grads
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        saved: ExpertsSaved = ctx.saved
        saved.tensors = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = experts_backward(saved, dy_TD, need, grad_buffers(saved.weights(), ctx.fuse_grads))
        saved.tensors = ()
        return *grads, None, None, None, None, None


def grad_buffer(w: torch.Tensor) -> torch.Tensor | None:
    """The gradient a weight's backward may add into directly: a leaf's existing .grad of the weight's shape (the
    optimizer's flat-buffer views, which it zeroes rather than frees). None: let autograd accumulate."""
    g = w.grad if w.is_leaf and w.requires_grad else None
    return g if g is not None and g.shape == w.shape and g.dtype in (torch.bfloat16, torch.float32) else None


def weight_grad(a_NM, b_NK, plan: RoutePlan, impl: str, needed: bool, into: torch.Tensor | None):
    """An expert weight's gradient for autograd to accumulate, or, with a gradient buffer given, added to it here
    (in the GEMM's epilogue where kernels/grouped_gemm.py can) and None returned."""
    if not needed:
        return None
    if into is None:
        return grouped_mm_wgrad(a_NM, b_NK, plan, impl)
    grouped_mm_wgrad_add_(into, a_NM, b_NK, plan, impl)
    return None


class _Fp8Gemms:
    """The FP8 grouped GEMMs of one plan: `mm(aq_NK, as_N, (bq_EKM, bs_EM))`, a weight operand from
    kernels/fp8_weights.py. gemm_impl "reference" emulates in fp32, "torch" runs torch._scaled_grouped_mm, "tma" our
    persistent TMA kernel; "auto" (or "triton") picks one of the last two per GEMM shape (grouped_gemm_tma.choose)."""

    def __init__(self, plan: RoutePlan, gemm_impl: str):
        self.plan = plan
        self.gemm_impl = gemm_impl

    def impl(self, K: int, M: int) -> str:
        if self.gemm_impl in ("reference", "torch", "tma"):
            return self.gemm_impl
        N, E = self.plan.row_token_N.numel(), self.plan.ends_E.numel()
        return "tma" if tma.choose(N, K, M, E, scaled=True) is not None else "torch"

    def __call__(self, aq_NK: torch.Tensor, as_N: torch.Tensor, b: Operand, saved: bool = True) -> torch.Tensor:
        """saved=False: the result is used once and freed, so it may be a view of a larger buffer."""
        impl = self.impl(aq_NK.shape[1], b[0].shape[2])
        return fp8.scaled_grouped_mm(aq_NK, as_N, *b, self.plan, impl, compact=saved)

    def presented(self, K: int, M: int) -> int:
        """How many rows an [N, K] @ [E, K, M] GEMM hands torch (kernels/fp8.py rows_to_present): the capacity its
        a operand's producer allocates, so that it is not copied there. Our kernel needs none."""
        if self.impl(K, M) != "torch":
            return 0
        return fp8.rows_to_present(self.plan.row_token_N.numel(), self.plan.ends_E.numel(), K, M)

    def gathered_rows(self, v_TD: torch.Tensor, capacity: int = 0):
        """Rows r of the expert-sorted buffer hold v[t(r)]: quantize the T tokens once and gather their e4m3 rows and
        scales. capacity: the e4m3 rows' buffer holds that many rows at least (presented)."""
        p = self.plan
        q_TD, s_T = fp8.quantize_rows(v_TD)
        s_N = s_T.index_select(0, p.row_token_N.clamp(min=0))  # rows >= R: any valid index (never read)
        return gather_rows(q_TD, p.row_token_N, p.num_rows, capacity=capacity), s_N


def fast_experts(
    x_TD: torch.Tensor,
    idx_TK: torch.Tensor,
    w_TK: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    e_start: int = 0,
    gemm_impl: str = "auto",
    precision: str = "bf16",
    fuse_grad_accumulation: bool = False,
    graphs: ExpertGraphs | None = None,
) -> torch.Tensor:
    """Same contract as trainer.moe.reference.experts_reference: y[t] = sum over local k of w[t,k] * expert(x[t]).

    gemm_impl: "auto" (on sm90 in bf16 or FP8: per GEMM shape our persistent TMA kernel or torch's CUTLASS one,
    kernels/grouped_gemm_tma.choose; elsewhere our Triton kernel), "torch", "tma", "triton" or "reference".
    precision: "bf16" | "fp8" (the module docstring says which GEMMs; "fp8" needs an sm90 GPU and D and F multiples
    of 16 unless gemm_impl is "reference", which emulates the FP8 GEMMs in fp32).
    Under torch.autocast the expert computation runs in the autocast dtype, as F.linear would, and y_TD comes back in
    that dtype; with precision="fp8" it runs in bf16 (the FP8 GEMMs' output dtype). Weight gradients come back in
    the weights' dtype (fp32 master weights get fp32 gradients). w_TK keeps its dtype (the reductions accumulate in
    fp32 either way). precision="fp8" inside kernels.fp8_weights.reuse_weights() quantizes each weight once per scope.
    fuse_grad_accumulation (model.moe.grad_accumulation_fusion): a weight that is a leaf with a .grad already (the
    trainer's gradient buffers) gets its gradient added to that .grad inside the backward, and autograd gets None
    for it. For .backward() only: torch.autograd.grad callers leave it off.
    graphs (model.moe.cuda_graph): this layer's kernels.moe_graph.ExpertGraphs, which replays a captured forward and
    backward where the call allows (bf16 on CUDA with gradients; the same kernels, so the same results) and runs
    eager otherwise.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"expert precision {precision!r} is not one of {PRECISIONS}")
    if precision == "fp8" and gemm_impl != "reference" and (x_TD.shape[-1] % FP8_DIM_MULTIPLE
                                                             or w_gate_EFD.shape[1] % FP8_DIM_MULTIPLE):
        raise ValueError(f"precision='fp8' needs the model dim ({x_TD.shape[-1]}) and the expert hidden size "
                         f"({w_gate_EFD.shape[1]}) to be multiples of {FP8_DIM_MULTIPLE} (16-byte aligned e4m3 rows)")
    dev = x_TD.device.type
    dt = torch.bfloat16 if precision == "fp8" else (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                                                     else None)
    weights = (w_gate_EFD, w_up_EFD, w_down_EDF)
    if dt is not None:
        x_TD = x_TD.to(dt)
        if precision != "fp8":  # fp8 quantizes the weights from their own dtype (kernels/fp8_weights.py)
            w_gate_EFD, w_up_EFD, w_down_EDF = (w.to(dt) for w in weights)
    # weights cast for this call are new tensors every call: a graph reading them by address cannot serve
    if graphs is not None and all(a is b for a, b in zip(weights, (w_gate_EFD, w_up_EFD, w_down_EDF))):
        return graphs(x_TD, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, idx_TK, int(e_start), gemm_impl, precision,
                      fuse_grad_accumulation)
    return _FastExperts.apply(x_TD, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, idx_TK, int(e_start), gemm_impl,
                              precision, fuse_grad_accumulation)
