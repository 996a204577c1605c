"""Plain-torch reference for the expert stage of an MoE layer. Kernels in kernels/ are tested against it.

Shapes: T tokens, D model dim, F expert hidden dim, K top-k, E local experts (a contiguous range
[e_start, e_start + E) of the global experts: the experts this EP rank owns).
Weights use nn.Linear's (out, in) layout: w_gate_EFD / w_up_EFD map D -> F, w_down_EDF maps F -> D.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_expert(
    x_ND: torch.Tensor, w_gate_FD: torch.Tensor, w_up_FD: torch.Tensor, w_down_DF: torch.Tensor
) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x_ND, w_gate_FD)) * F.linear(x_ND, w_up_FD), w_down_DF)


def experts_reference(
    x_TD: torch.Tensor,
    idx_TK: torch.Tensor,
    w_TK: torch.Tensor,
    w_gate_EFD: torch.Tensor,
    w_up_EFD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    e_start: int = 0,
) -> torch.Tensor:
    """y[t] = sum over k with idx[t,k] in [e_start, e_start+E) of w[t,k] * expert_{idx[t,k]}(x[t]).

    Sorts (token, k) pairs by expert (stable, so the summation order is deterministic) and loops over experts.
    Autograd flows to x, w_TK and every weight.
    """
    T, K = idx_TK.shape
    E = w_gate_EFD.shape[0]
    flat_idx = idx_TK.reshape(-1) - e_start
    local = (flat_idx >= 0) & (flat_idx < E)
    order = torch.argsort(torch.where(local, flat_idx, E), stable=True)
    counts = torch.bincount(flat_idx[local], minlength=E).tolist()  # host sync: fine for a reference
    token_of_pair = torch.arange(T * K, device=x_TD.device) // K
    y_TD = torch.zeros_like(x_TD)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = token_of_pair[pairs]
        out_ND = swiglu_expert(x_TD[tokens], w_gate_EFD[e], w_up_EFD[e], w_down_EDF[e])
        weight_N1 = w_TK.reshape(-1)[pairs].unsqueeze(-1).to(out_ND.dtype)
        y_TD = y_TD.index_add(0, tokens, out_ND * weight_N1)
    return y_TD
