"""Both EP token exchanges on 4 gloo ranks equal the reference experts on one process — outputs and the gradients of
tokens, top-k weights and expert weights — including skewed routing where some ranks receive no tokens at all."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_launch.conf.schema import ParallelConfig
from moe_launch.trainer.moe.reference import experts_reference
from moe_launch.trainer.parallel.dispatch import make_dispatcher
from moe_launch.trainer.parallel.groups import build_groups

EP, T, D, F, E, K = 4, 6, 4, 3, 8, 2


class ExpertsOnly(nn.Module):
    """The attributes a dispatcher uses of the MoE layer (trainer/moe/layer.py), holding experts [e_start, +E_local)."""

    def __init__(self, w_gate_EFD, w_up_EFD, w_down_EDF, e_start: int):
        super().__init__()
        self.w_gate_EFD, self.w_up_EFD = nn.Parameter(w_gate_EFD.clone()), nn.Parameter(w_up_EFD.clone())
        self.w_down_EDF = nn.Parameter(w_down_EDF.clone())
        self.e_start, self.num_experts, self.experts_fn = e_start, E, experts_reference


def problem(routing: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = EP * T
    if routing == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    elif routing == "all_to_rank0":  # ranks 1..3 receive nothing
        idx = torch.tensor([[0, 1]] * n)
    else:  # "last_expert_only_k": one pair per token to the last expert, ragged counts elsewhere
        idx = torch.stack([torch.tensor([E - 1, t % (E - 1)]) for t in range(n)])
    return {"x": torch.randn(n, D, generator=g), "w": torch.rand(n, K, generator=g), "idx": idx,
            "wg": torch.randn(E, F, D, generator=g), "wu": torch.randn(E, F, D, generator=g),
            "wd": torch.randn(E, D, F, generator=g), "probe": torch.randn(n, D, generator=g)}


def run(x, w, idx, layer, probe, dispatcher=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    if dispatcher is None:
        y = layer.experts_fn(x, idx, w, layer.w_gate_EFD, layer.w_up_EFD, layer.w_down_EDF, e_start=layer.e_start)
    else:
        y = dispatcher(x, idx, w, layer)
    (y * probe).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "dwg": layer.w_gate_EFD.grad, "dwu": layer.w_up_EFD.grad,
            "dwd": layer.w_down_EDF.grad}


def _dispatch_worker(rank: int, world: int, name: str, routing: str) -> dict:
    groups = build_groups(ParallelConfig(dp=1, ep=EP))
    p = problem(routing)
    e_local = E // EP
    ex = slice(rank * e_local, (rank + 1) * e_local)
    tok = slice(rank * T, (rank + 1) * T)
    layer = ExpertsOnly(p["wg"][ex], p["wu"][ex], p["wd"][ex], e_start=rank * e_local)
    return run(p["x"][tok], p["w"][tok], p["idx"][tok], layer, p["probe"][tok], make_dispatcher(name, groups.ep))


@pytest.mark.parametrize("routing", ["random", "all_to_rank0", "last_expert_only_k"])
def test_dispatchers_equal_reference(rank_pool, routing):
    p = problem(routing)
    ref = run(p["x"], p["w"], p["idx"], ExpertsOnly(p["wg"], p["wu"], p["wd"], 0), p["probe"])
    e_local = E // EP
    for name in ("allgather", "alltoall"):
        for rank, out in enumerate(rank_pool.run(_dispatch_worker, EP, name, routing)):
            tok, ex = slice(rank * T, (rank + 1) * T), slice(rank * e_local, (rank + 1) * e_local)
            expected = {"y": ref["y"][tok], "dx": ref["dx"][tok], "dw": ref["dw"][tok], "dwg": ref["dwg"][ex],
                        "dwu": ref["dwu"][ex], "dwd": ref["dwd"][ex]}
            for key, want in expected.items():
                got = torch.zeros_like(want) if out[key] is None else out[key]  # experts that saw no token: None
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, k=key, n=name, r=rank: f"{n} rank {r} {k}: {m}")
