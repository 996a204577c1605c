"""Both expert paths see the same balanced routing: a MoELayer with model.moe.balance=aux_free_bias (a nonzero bias)
or sinkhorn gives the same output, counts and gradients with the FastSparseMoE kernels as with the reference."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import rel_err

from moe_launch.conf.schema import MoEConfig
from moe_launch.trainer.moe.layer import MoELayer


@pytest.mark.parametrize("balance", ["aux_free_bias", "sinkhorn"])
def test_fast_and_reference_route_alike_under_balancing(balance):
    torch.manual_seed(0)
    layers = [MoELayer(16, MoEConfig(num_experts=8, top_k=2, expert_hidden=32, impl=impl, balance=balance))
              for impl in ("reference", "fast")]
    for p in layers[0].parameters():
        torch.nn.init.normal_(p, std=0.2)
    if balance == "aux_free_bias":
        with torch.no_grad():
            layers[0].router.expert_bias_E.copy_(torch.linspace(0.2, -0.2, 8))
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(3, 20, 16)
    outs = []
    for layer in layers:
        y, stats = layer(x)
        y.square().sum().backward()
        outs.append((y.detach(), stats.counts_E, {n: p.grad for n, p in layer.named_parameters() if p.requires_grad}))
    assert torch.equal(outs[0][1], outs[1][1])
    assert rel_err(outs[1][0], outs[0][0]) <= 1e-5
    for n, g in outs[0][2].items():
        assert rel_err(outs[1][2][n], g) <= 1e-5, n
