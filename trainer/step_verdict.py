"""The step's decision collective: every rank's fault flag, the stop request and the loss parts in one all-reduce.

    verdict = agree(comm, rank, world, local_P, local_norm, stop_requested, persisting)

P = the 4 loss parts (loss, lm_loss, aux_loss, z_loss). The reduced float64 vector, packed and unpacked here only:

    [fault flag of rank 0 .. world-1 | stop flag | persisting flag | loss parts P summed over ranks]

`persisting`: this rank's background checkpoint write is still running. A checkpoint due while any rank's is may be
skipped (train.ckpt_when_busy=skip); deciding from the reduced flag makes every rank skip the same checkpoints.

Each rank flags its OWN non-finite loss or local gradient norm before any gradient reduction could spread a NaN, so
the flag names the faulty rank. The flags stay on the device until one host read (the step's host sync), and every
rank takes the same decision from the same reduced vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_launch.trainer.dist import Comm

N_PARTS = 4


@dataclass(frozen=True)
class Verdict:
    faulty: list[int]  # ranks whose loss or local gradient norm was not finite
    stop: bool  # some rank was asked to stop (SIGUSR2 / SIGTERM)
    persisting: bool  # some rank's previous checkpoint was still being written when the step began its collective
    mean_P: torch.Tensor  # the loss parts averaged over the ranks


def pack(rank: int, world: int, local_P: torch.Tensor, local_norm: torch.Tensor, stop: bool,
         persisting: bool = False) -> torch.Tensor:
    shared = torch.zeros(world + 2 + N_PARTS, dtype=torch.float64, device=local_P.device)
    shared[rank] = (~(torch.isfinite(local_P[0]) & torch.isfinite(local_norm))).double()
    shared[world] = 1.0 if stop else 0.0
    shared[world + 1] = 1.0 if persisting else 0.0
    shared[world + 2:] = local_P
    return shared


def unpack(reduced: torch.Tensor, world: int) -> Verdict:
    flags = reduced[: world + 2].tolist()  # the host sync
    return Verdict(faulty=[r for r in range(world) if flags[r] > 0], stop=flags[world] > 0,
                   persisting=flags[world + 1] > 0, mean_P=reduced[world + 2:] / world)


def agree(comm: Comm, rank: int, world: int, local_P: torch.Tensor, local_norm: torch.Tensor, stop: bool,
          persisting: bool = False) -> Verdict:
    shared = pack(rank, world, local_P, local_norm, stop, persisting)
    comm.all_reduce_(shared)  # the one extra collective of the step
    return unpack(shared, world)
