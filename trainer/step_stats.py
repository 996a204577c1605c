"""What a logged step reports, read back to the host without waiting for the optimizer update.

Shapes: P = 4 loss parts (loss, lm, aux, z), L MoE layers of this stage, E experts.

The step's host sync is the verdict (trainer/step_verdict.py), before the update is queued. A host read of anything
on the device after the update is queued waits for the whole update (tens of milliseconds at the 16-layer OLMoE
shape), and while the host then logs (TensorBoard histograms, metrics.jsonl, the log line) the device has nothing to
run. So on log steps everything the record and the skew alerts need is gathered into one buffer right after the
verdict and copied to (pinned) host memory, queued ahead of the update:

    pending = start_copy(mean_P, per_layer, counts_LE)    before the update is queued
    ... optimizer.step ...
    stats = pending.get()                                  waits for the copy only, not for the update

The host then logs while the device runs the update, and the next step's launches find the device still busy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class StepStats:
    mean_P: list[float]  # the loss parts averaged over the ranks
    aux_L: list[float]  # per MoE layer, unweighted, averaged over the step's micro-batches
    z_L: list[float]
    counts_LE: Optional[torch.Tensor]  # int64 on the host; None for a dense model


class PendingStats:
    def __init__(self, host: torch.Tensor, done: Optional[torch.cuda.Event], n_layers: int, n_experts: int,
                 has_counts: bool):
        self._host, self._done = host, done
        self._L, self._E, self._has_counts = n_layers, n_experts, has_counts

    def get(self) -> StepStats:
        if self._done is not None:
            self._done.synchronize()
        v, L = self._host, self._L
        counts_LE = v[4 + 2 * L:].reshape(L, self._E).to(torch.int64) if self._has_counts else None
        return StepStats(mean_P=v[:4].tolist(), aux_L=v[4:4 + L].tolist(), z_L=v[4 + L:4 + 2 * L].tolist(),
                         counts_LE=counts_LE)


def _layer_means(per_layer: list, key: str, n_layers: int, device: torch.device) -> torch.Tensor:
    """[L] mean over micro-batches of each layer's scalar `key`."""
    if n_layers == 0:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([torch.stack(getattr(p, key)).double() for p in per_layer]).mean(0)


def start_copy(mean_P: torch.Tensor, per_layer: list, counts_LE: Optional[torch.Tensor]) -> PendingStats:
    """Queue the copy of the step's reported values to the host. per_layer: the LossParts of the micro-batches;
    counts_LE: the step's global expert counts. Counts travel as float64 (exact below 2^53)."""
    device = mean_P.device
    n_layers = len(per_layer[0].aux_per_layer)
    parts = [mean_P.double().reshape(-1), _layer_means(per_layer, "aux_per_layer", n_layers, device),
             _layer_means(per_layer, "z_per_layer", n_layers, device)]
    if counts_LE is not None:
        parts.append(counts_LE.double().reshape(-1))
    payload = torch.cat(parts)
    cuda = payload.is_cuda
    host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=cuda)
    host.copy_(payload, non_blocking=cuda)
    done = None
    if cuda:
        done = torch.cuda.Event()
        done.record()
    n_experts = counts_LE.shape[1] if counts_LE is not None else 0
    return PendingStats(host, done, n_layers, n_experts, counts_LE is not None)
