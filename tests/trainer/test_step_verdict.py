"""The step's decision vector (trainer/step_verdict.py): what three ranks pack, summed as the all-reduce sums it,
unpacks to the faulty ranks, the stop request and the mean loss parts."""

from __future__ import annotations

import torch

from moe_launch.trainer.dist import Comm
from moe_launch.trainer.step_verdict import agree, pack, unpack


def _parts(loss: float) -> torch.Tensor:
    return torch.tensor([loss, loss - 0.5, 0.25, 0.25], dtype=torch.float64)


def test_three_ranks_one_faulty_one_stopping():
    world = 3
    packed = [pack(0, world, _parts(2.0), torch.tensor(1.0), stop=False),
              pack(1, world, _parts(4.0), torch.tensor(float("inf")), stop=False),  # its own gradient blew up
              pack(2, world, _parts(3.0), torch.tensor(1.0), stop=True)]
    verdict = unpack(sum(packed), world)
    assert verdict.faulty == [1] and verdict.stop
    assert torch.equal(verdict.mean_P, torch.tensor([3.0, 2.5, 0.25, 0.25], dtype=torch.float64))


def test_nan_loss_flags_the_rank_and_a_clean_step_flags_none():
    world = 2
    nan = unpack(pack(0, world, _parts(1.0), torch.tensor(1.0), False) +
                 pack(1, world, _parts(float("nan")), torch.tensor(1.0), False), world)
    assert nan.faulty == [1] and not nan.stop
    clean = agree(Comm(), 0, 1, _parts(1.0), torch.tensor(1.0), stop=False)  # a single process: no group needed
    assert clean.faulty == [] and not clean.stop and float(clean.mean_P[0]) == 1.0


def test_one_rank_still_persisting_makes_every_rank_see_it():
    world = 2
    verdict = unpack(pack(0, world, _parts(1.0), torch.tensor(1.0), False, persisting=False) +
                     pack(1, world, _parts(1.0), torch.tensor(1.0), False, persisting=True), world)
    assert verdict.persisting and not verdict.stop and verdict.faulty == []
    idle = agree(Comm(), 0, 1, _parts(1.0), torch.tensor(1.0), stop=False)
    assert not idle.persisting
