"""Router auxiliary losses and load statistics, computed on one rank's own tokens (before any EP dispatch).

Shapes: T tokens, E global experts, K top-k.
"""

from __future__ import annotations

import torch


def expert_counts(idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(token, slot) pairs routed to each expert, int64 [E]. A scatter-add into E counters rather than
    torch.bincount, which reads the largest id back to the host (a sync in every MoE layer's forward); integer sums
    are exact in any order, so this stays deterministic."""
    flat = idx_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Switch Transformer loss E * sum_e f_e * P_e: f_e the fraction of pairs sent to e (no gradient), P_e the
    mean router probability of e. Equals 1 under perfect balance, E under total collapse."""
    E = probs_TE.shape[-1]
    f_E = counts_E.to(probs_TE.dtype) / counts_E.sum().clamp(min=1)
    return E * torch.dot(f_E, probs_TE.mean(dim=0))


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean squared log-partition, keeps router logits small (fp32 stability)."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def load_imbalance(counts_E: torch.Tensor) -> torch.Tensor:
    """max over experts of count / mean count: 1.0 is perfect balance, E is total collapse."""
    counts = counts_E.float()
    return counts.max() / counts.mean().clamp(min=1e-9)
