"""Token-choice top-k router: linear -> softmax in fp32 -> expert selection -> combine weights.

Shapes: T tokens, D model dim, E global experts, K top-k.
Selection and combine weights are separate on purpose: `model.moe.balance` may change WHICH experts a token goes to
(a learned per-expert bias, or Sinkhorn-normalised scores), but the combine weights are always the router's own
softmax probabilities at the chosen experts, so gradients reach the router exactly as they would for that choice.
  aux_loss       top-k of the probabilities (balance comes from the aux loss the model adds)
  aux_free_bias  top-k of probabilities + expert_bias_E; the bias is moved towards the mean load after every
                 optimizer step (trainer/moe/balance.py), never by a gradient
  sinkhorn       top-k of the Sinkhorn-normalised scores: every expert gets an equal share of the probability mass
Forced uniform routing (model.moe.uniform_routing) replaces the selection by a fixed round-robin assignment in which
every expert receives exactly T*K/E (token, slot) pairs. It exists to benchmark kernels and dispatchers without load
imbalance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_launch.conf.schema import MoEConfig

# Sinkhorn rounds per forward: a fixed count keeps the router free of host syncs (a tolerance test would read a
# value back every round); the column sums are within a few percent of equal after this many on skewed inputs
SINKHORN_ROUNDS = 8


@dataclass
class Routing:
    idx_TK: torch.Tensor  # int64 global expert ids
    w_TK: torch.Tensor  # fp32 combine weights
    logits_TE: torch.Tensor  # fp32
    probs_TE: torch.Tensor  # fp32


def uniform_assignment(T: int, K: int, E: int, device: torch.device) -> torch.Tensor:
    """Slot k of token t goes to expert (t*K + k) mod E: K distinct experts per token, balanced counts."""
    return (torch.arange(T, device=device).unsqueeze(1) * K + torch.arange(K, device=device)) % E


@torch.no_grad()
def sinkhorn_log_scores(logits_TE: torch.Tensor, rounds: int = SINKHORN_ROUNDS) -> torch.Tensor:
    """log of the doubly-normalised exp(logits): alternately make every expert's column hold 1/E of the mass and
    every token's row sum to 1 (log space: no overflow for large logits). Monotone per token in neither the logits
    nor the probabilities, which is the point: a token may go to a less preferred but less loaded expert."""
    log_TE = logits_TE.float()
    for _ in range(rounds):
        log_TE = log_TE - log_TE.logsumexp(dim=0, keepdim=True)
        log_TE = log_TE - log_TE.logsumexp(dim=1, keepdim=True)
    return log_TE


# torch.mm(..., out_dtype=fp32) on bf16 operands (CUDA, in the torch versions that have the overload): tensor cores
# with the fp32 accumulator written out as is
_MM_FP32_OUT = hasattr(torch.ops.aten.mm, "dtype")


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_cuda and _MM_FP32_OUT:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # the same numbers: bf16 products are exact in fp32


class _Bf16Logits(torch.autograd.Function):
    """fp32 logits of bf16 tokens and a bf16 router weight. The forward gives the fp32 GEMM's result (the products of
    bf16 values are exact in fp32, the sum is fp32) at the bf16 tensor-core rate, not the fp32 SIMT one, and without
    fp32 copies of the tokens. The backward rounds the logits' gradient to bf16 for two bf16 GEMMs (fp32
    accumulation): both gradients are rounded to bf16 afterwards anyway."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        return _mm_fp32_out(x_TD, w_ED.t())

    @staticmethod
    def backward(ctx, g_TE: torch.Tensor):
        x_TD, w_ED = ctx.saved_tensors
        g_TE = g_TE.to(x_TD.dtype)
        dx_TD = g_TE @ w_ED if ctx.needs_input_grad[0] else None
        dw_ED = g_TE.t() @ x_TD if ctx.needs_input_grad[1] else None
        return dx_TD, dw_ED


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor, gemm: str = "bf16") -> torch.Tensor:
    """fp32 logits [T, E] whatever the operands' dtype (autocast off: the softmax and the z-loss are sensitive to
    rounding). gemm (model.moe.router_gemm) "bf16" runs bf16 operands on the tensor cores (_Bf16Logits); anything
    else is an fp32 GEMM."""
    with torch.autocast(device_type=x_TD.device.type, enabled=False):
        if gemm == "bf16" and x_TD.dtype == w_ED.dtype == torch.bfloat16:
            return _Bf16Logits.apply(x_TD, w_ED)
        return F.linear(x_TD.float(), w_ED.float())


Select = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # (logits_TE, probs_TE, K) -> idx_TK


def select_topk(logits_TE: torch.Tensor, probs_TE: torch.Tensor, K: int) -> torch.Tensor:
    return probs_TE.topk(K, dim=-1).indices


def select_sinkhorn(logits_TE: torch.Tensor, probs_TE: torch.Tensor, K: int) -> torch.Tensor:
    return sinkhorn_log_scores(logits_TE).topk(K, dim=-1).indices


def select_uniform(logits_TE: torch.Tensor, probs_TE: torch.Tensor, K: int) -> torch.Tensor:
    return uniform_assignment(probs_TE.shape[0], K, probs_TE.shape[1], probs_TE.device)


class Router(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.norm_topk_prob, self.balance, self.gemm = cfg.norm_topk_prob, cfg.balance, cfg.router_gemm
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))
        self.expert_bias_E: Optional[nn.Parameter] = None
        if cfg.balance == "aux_free_bias":
            # a Parameter without gradient rather than a buffer: checkpoints, model-only restarts and the DP/EP
            # broadcast carry parameters, and the optimizer skips it (requires_grad=False). Kept fp32 (see
            # trainer/dtypes.py cast_parameters): its steps are far below bf16's resolution at its magnitude
            self.expert_bias_E = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.select: Select = {"aux_loss": select_topk, "aux_free_bias": self._select_biased,
                               "sinkhorn": select_sinkhorn}[cfg.balance]
        if cfg.uniform_routing:
            self.select = select_uniform

    def _select_biased(self, logits_TE: torch.Tensor, probs_TE: torch.Tensor, K: int) -> torch.Tensor:
        return (probs_TE.detach() + self.expert_bias_E.float()).topk(K, dim=-1).indices

    def forward(self, x_TD: torch.Tensor) -> Routing:
        logits_TE = router_logits(x_TD, self.weight, self.gemm)
        probs_TE = logits_TE.softmax(dim=-1)
        idx_TK = self.select(logits_TE.detach(), probs_TE, self.top_k)
        w_TK = probs_TE.gather(1, idx_TK)
        if self.norm_topk_prob:
            w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
        return Routing(idx_TK=idx_TK, w_TK=w_TK, logits_TE=logits_TE, probs_TE=probs_TE)
