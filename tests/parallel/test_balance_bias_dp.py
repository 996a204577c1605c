"""aux_free_bias under data parallelism: each rank sees its own tokens' load, but the bias step is taken on the load
summed over the DP x EP group, so every replica's bias stays identical (and equals the single-process step on the
whole batch's load)."""

from __future__ import annotations

import torch

from moe_launch.conf.schema import MoEConfig, ParallelConfig
from moe_launch.trainer.moe.balance import BiasBalancer, bias_step_E
from moe_launch.trainer.moe.router import Router
from moe_launch.trainer.parallel.groups import build_groups

LOCAL_LOADS = [[10, 0, 0, 0], [0, 0, 1, 5]]  # rank r's own load: alone, each would step differently


def _worker(rank: int, world: int) -> torch.Tensor:
    groups = build_groups(ParallelConfig(dp=world))
    router = Router(8, MoEConfig(num_experts=4, top_k=1, balance="aux_free_bias"))
    balancer = BiasBalancer.of(router, 0.1, groups.dp_ep)
    for _ in range(3):
        balancer.update([torch.tensor(LOCAL_LOADS[rank])])
    return router.expert_bias_E.detach().clone()


def test_replicas_take_the_same_step_from_the_global_load(rank_pool):
    biases = rank_pool.run(_worker, 2)
    assert torch.equal(biases[0], biases[1])
    want = 3 * bias_step_E(torch.tensor(LOCAL_LOADS).sum(0), 0.1).float()
    torch.testing.assert_close(biases[0], want)
    alone = 3 * bias_step_E(torch.tensor(LOCAL_LOADS[0]), 0.1).float()
    assert not torch.equal(biases[0], alone)
