"""ShardedAdamW: replicated equals torch.optim.AdamW; ZeRO-1 / EPSO on 4 gloo ranks equal one process; the global
gradient norm counts every element once; the state bytes per rank match the theory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_launch.conf.schema import ParallelConfig, TrainConfig
from moe_launch.errors import ConfigError
from moe_launch.trainer.parallel.groups import build_groups, coords_of, group_ranks
from moe_launch.trainer.parallel.optimizer import build_optimizer

E_GLOBAL, STEPS, CLIP = 4, 5, 0.8
TRAIN = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)


class ToyParams(nn.Module):
    """Dense matrix (decay), a vector (no decay) and expert weights holding experts [e_start, e_start + E/ep).
    Sizes are odd on purpose so that every shard layout needs padding."""

    def __init__(self, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_DD = nn.Parameter(torch.randn(7, 5, generator=g))
        self.b_D = nn.Parameter(torch.randn(5, generator=g))
        w_EFD = torch.randn(E_GLOBAL, 3, 5, generator=g)
        e_local = E_GLOBAL // ep_size
        self.w_EFD = nn.Parameter(w_EFD[ep_rank * e_local : (ep_rank + 1) * e_local].clone())
        self.w_EFD._moe_expert = True


def local_grads(step: int, data_rank: int) -> dict[str, torch.Tensor]:
    """The gradient one data rank would compute from its own tokens, for the full (all-expert) parameter set."""
    g = torch.Generator().manual_seed(1000 * step + data_rank)
    return {"w_DD": torch.randn(7, 5, generator=g), "b_D": torch.randn(5, generator=g),
            "w_EFD": torch.randn(E_GLOBAL, 3, 5, generator=g)}


def _optimizer_worker(rank: int, world: int, dp: int, ep: int, strategy: str) -> dict:
    pcfg = ParallelConfig(dp=dp, ep=ep, optimizer_sharding=strategy)
    groups = build_groups(pcfg)
    model = ToyParams(groups.ep_rank, groups.ep_size)
    opt = build_optimizer(model, TRAIN, pcfg, groups)
    e_local = E_GLOBAL // ep
    sl = slice(groups.ep_rank * e_local, (groups.ep_rank + 1) * e_local)
    norms = []
    for step in range(STEPS):
        mine = local_grads(step, groups.data_rank)
        model.w_DD.grad, model.b_D.grad = mine["w_DD"], mine["b_D"]
        # expert weights receive the tokens of every EP rank of this DP index (what the token exchange does)
        model.w_EFD.grad = sum(local_grads(step, groups.dp_rank * ep + i)["w_EFD"][sl] for i in range(ep))
        opt.reduce_grads()
        norms.append(opt.clip_grad_norm_(CLIP))
        opt.step(TRAIN.lr * (1 + step) / STEPS)
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms,
            "state_bytes": opt.optimizer_state_bytes(), "ep_rank": groups.ep_rank, "dp_rank": groups.dp_rank}


def _reference(data_size: int, clip: float = CLIP) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, torch.optim.AdamW + clip_grad_norm_ on the mean of all data ranks' gradients."""
    model = ToyParams()
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN.lr, betas=(TRAIN.beta1, TRAIN.beta2), eps=TRAIN.eps,
                            weight_decay=TRAIN.weight_decay, foreach=False)
    opt.param_groups[0]["params"] = [model.w_DD, model.w_EFD]
    opt.add_param_group({"params": [model.b_D], "weight_decay": 0.0})
    norms = []
    for step in range(STEPS):
        grads = [local_grads(step, r) for r in range(data_size)]
        for n, p in model.named_parameters():
            p.grad = sum(g[n] for g in grads) / data_size
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        for group in opt.param_groups:
            group["lr"] = TRAIN.lr * (1 + step) / STEPS
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def test_replicated_single_process_is_torch_adamw_bitwise():
    # without clipping: torch sums the squared norm in fp32, we in fp64, so clipped runs agree only to rounding
    groups = build_groups(ParallelConfig())  # no process group at all
    model = ToyParams()
    opt = build_optimizer(model, TRAIN, ParallelConfig(), groups)
    ref_params, ref_norms = _reference(data_size=1, clip=0.0)
    for step in range(STEPS):
        for n, p in model.named_parameters():
            p.grad = local_grads(step, 0)[n].clone()
        opt.reduce_grads()
        norm = opt.clip_grad_norm_(0.0)
        assert norm == pytest.approx(ref_norms[step], rel=1e-6)
        opt.step(TRAIN.lr * (1 + step) / STEPS)
        opt.zero_grad()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref_params[n]), n


@pytest.mark.parametrize("dp,ep", [(2, 2), (1, 4)])
def test_sharded_strategies_on_four_ranks_equal_one_process(rank_pool, dp, ep):
    ref_params, ref_norms = _reference(data_size=dp * ep)
    e_local = E_GLOBAL // ep
    expert_local = e_local * 3 * 5
    for strategy in ("none", "zero1", "epso"):
        results = rank_pool.run(_optimizer_worker, 4, dp, ep, strategy)
        for r in results:
            assert r["norms"] == pytest.approx(ref_norms, rel=1e-6), strategy
            sl = slice(r["ep_rank"] * e_local, (r["ep_rank"] + 1) * e_local)
            torch.testing.assert_close(r["params"]["w_DD"], ref_params["w_DD"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r["params"]["b_D"], ref_params["b_D"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r["params"]["w_EFD"], ref_params["w_EFD"][sl], rtol=1e-5, atol=1e-6)
        # dense buckets: 35 (decay) + 5 (no decay) elements; theory: 12 bytes (fp32 master, exp_avg,
        # exp_avg_sq) per element of each bucket's (padded) shard
        ceil = lambda n, k: -(-n // k)  # noqa: E731
        shards = {
            "none": (35, 5, expert_local),
            "zero1": (ceil(35, dp), ceil(5, dp), ceil(expert_local, dp)),
            "epso": (ceil(35, dp * ep), ceil(5, dp * ep), ceil(expert_local, dp)),
        }[strategy]
        expected = 12 * sum(shards)
        print(f"dp={dp} ep={ep} {strategy}: optimizer state bytes per rank {[r['state_bytes'] for r in results]} "
              f"(theory {expected})")
        assert all(r["state_bytes"] == expected for r in results), strategy


def test_group_layout_puts_ep_innermost():
    groups = group_ranks(dp=2, ep=2, pp=2)
    assert groups["ep"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert groups["dp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups["dp_ep"] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert groups["pp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert coords_of(6, dp=2, ep=2) == (1, 1, 0)


def test_world_size_mismatch_names_the_key():
    with pytest.raises(ConfigError, match="parallel.dp"):
        build_groups(ParallelConfig(dp=2, ep=2))


def test_bf16_parameters_keep_fp32_master_weights():
    groups = build_groups(ParallelConfig())
    model = ToyParams().to(torch.bfloat16)
    opt = build_optimizer(model, TRAIN, ParallelConfig(), groups)
    tiny_lr = 1e-5  # updates far below bf16 resolution: only an fp32 master accumulates them
    for step in range(3):
        for n, p in model.named_parameters():
            p.grad = local_grads(step, 0)[n].to(torch.bfloat16)
        opt.reduce_grads()
        opt.step(tiny_lr)
        opt.zero_grad()
    master = {b.name: b.master for b in opt.buckets}
    assert set(master) == {"expert.decay.bfloat16", "dense.decay.bfloat16", "dense.no_decay.bfloat16"}
    start_fp32 = ToyParams().w_DD.detach().to(torch.bfloat16).float()  # where the master started
    b = next(b for b in opt.buckets if b.name == "dense.decay.bfloat16")
    moved = (b.master[:35].view(7, 5) - start_fp32).abs()
    assert moved.max() > 1e-5  # the master accumulated the updates...
    assert torch.equal(model.w_DD.detach(), b.master[:35].view(7, 5).to(torch.bfloat16))  # ...params follow it


def test_load_state_dict_refuses_another_layout():
    from moe_launch.errors import CheckpointError
    from moe_launch.trainer.checkpoint.reshard import reshard_optimizer_state

    groups = build_groups(ParallelConfig())
    opt = build_optimizer(ToyParams(), TRAIN, ParallelConfig(), groups)
    sd = opt.state_dict()
    sd["buckets"]["dense.decay.float32"]["shard_count"] = 2
    with pytest.raises(CheckpointError, match="reshards"):
        opt.load_state_dict(sd)
    with pytest.raises(CheckpointError, match="parallel.ep"):
        reshard_optimizer_state(opt, {"dp": 1, "ep": 2, "optimizer_sharding": "epso"}, lambda r: sd)
