"""Sparse upcycling: turn a dense model's state into an MoE model's state by copying each dense SwiGLU into every
expert. With one expert and top-1 routing the MoE computes exactly the dense function (the router's softmax over
one expert is 1), which is the handbook's check that the MoE plumbing is right."""

from __future__ import annotations

import torch

_FFN = {"gate_proj.weight": "w_gate_EFD", "up_proj.weight": "w_up_EFD", "down_proj.weight": "w_down_EDF"}


def upcycle_dense_state(dense_sd: dict[str, torch.Tensor], num_local_experts: int) -> dict[str, torch.Tensor]:
    """Dense state dict -> MoE state dict without router weights (load with strict=False, keep the router's init)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in dense_sd.items():
        prefix, _, leaf = key.partition(".ffn.")
        if leaf in _FFN:
            out[f"{prefix}.ffn.{_FFN[leaf]}"] = value.unsqueeze(0).repeat(num_local_experts, 1, 1).clone()
        else:
            out[key] = value.clone()
    return out
