"""Checkpoints under DP × EP, through the trainer's own checkpoint files (trainer/checkpoint):
resume at DP=2×EP=2 is bitwise equal to not stopping; a checkpoint written at DP=2 loads at DP=1 (resharded
optimizer state, also across sharding strategies) and continues like the single-process run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from par_training import MICRO_BATCHES, parallel_setup, parallel_steps, reference_run

from moe_launch.trainer.checkpoint import layout, relayout
from moe_launch.trainer.checkpoint import state as ckpt_state
from moe_launch.trainer.checkpoint.layout import model_shard_writer
from moe_launch.trainer.checkpoint.reshard import holder_of, shard_of
from moe_launch.trainer.checkpoint.resume import load_optimizer_resharded, resume_mode
from moe_launch.trainer.dist import Comm
from moe_launch.trainer.parallel.broadcast import broadcast_model
from moe_launch.trainer.parallel.groups import coords_of

STEPS, STOP_AT = 5, 3


def _coords(groups, strategy: str) -> layout.Coords:
    return layout.Coords(rank=groups.world_rank, dp_rank=groups.dp_rank, ep_rank=groups.ep_rank,
                         ep_size=groups.ep_size, optimizer_sharding=strategy, is_moe=True, dp_size=groups.dp_size)


def _save(ckpt: Path, groups, model, opt, strategy: str) -> None:
    saved_layout = {"dp": groups.dp_size, "ep": groups.ep_size, "pp": 1, "optimizer_sharding": strategy}
    ckpt_state.save(ckpt, STOP_AT, _coords(groups, strategy), model, opt, {"layout": saved_layout}, Comm(),
                    torch.device("cpu"))


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _resume_worker(rank: int, world: int, tmp: str, strategy: str, dispatcher: str) -> dict:
    torch.use_deterministic_algorithms(True)
    groups, model, opt = parallel_setup(2, 2, strategy, dispatcher)
    straight, _ = parallel_steps(groups, model, opt, 0, STEPS)
    uninterrupted = _snapshot(model)

    groups, model, opt = parallel_setup(2, 2, strategy, dispatcher)
    first, _ = parallel_steps(groups, model, opt, 0, STOP_AT)
    ckpt = Path(tmp) / f"ckpt-{strategy}-{dispatcher}"
    _save(ckpt, groups, model, opt, strategy)
    del model, opt

    # a fresh process state: different initial weights, then load (dp 0 reads, the others get the broadcast)
    groups, model, opt = parallel_setup(2, 2, strategy, dispatcher, perturb_non_source=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    coords = _coords(groups, strategy)
    if groups.dp_rank == 0:
        ckpt_state.load_model(ckpt, coords, model)
    broadcast_model(model, groups)
    opt.sync_master_from_params()
    reads = ckpt_state.load_optimizer(ckpt, coords, opt, groups)
    rest, _ = parallel_steps(groups, model, opt, STOP_AT, STEPS - STOP_AT)
    return {"straight": straight, "resumed": first + rest, "uninterrupted": uninterrupted, "final": _snapshot(model),
            "reads": reads, "dp_rank": groups.dp_rank, "ep_rank": groups.ep_rank, "rank": groups.world_rank}


@pytest.mark.parametrize("strategy,dispatcher", [("epso", "alltoall"), ("zero1", "allgather"), ("none", "alltoall")])
def test_resume_at_dp2_ep2_is_bitwise_equal_to_not_stopping(rank_pool, tmp_path, strategy, dispatcher):
    for r in rank_pool.run(_resume_worker, 4, str(tmp_path), strategy, dispatcher):
        assert r["resumed"] == r["straight"]  # exact float equality of every step's loss
        for name, p in r["uninterrupted"].items():
            assert torch.equal(r["final"][name], p), name
        if strategy == "none":  # the replicated file is read by one rank per DP group, the others get a broadcast
            assert r["reads"] == ([f"optim/ep{r['ep_rank']}.pt"] if r["dp_rank"] == 0 else []), r
        else:
            assert r["reads"] == [f"optim/rank{r['rank']}.pt"], r


def _save_worker(rank: int, world: int, tmp: str, strategy: str) -> None:
    groups, model, opt = parallel_setup(2, 2, strategy, "alltoall")
    parallel_steps(groups, model, opt, 0, STOP_AT)
    _save(Path(tmp) / "ckpt", groups, model, opt, strategy)


def _reshard_worker(rank: int, world: int, tmp: str, saved_strategy: str, new_strategy: str) -> dict:
    ckpt = Path(tmp) / "ckpt"
    saved_layout = ckpt_state.load_trainer_state(ckpt)["layout"]
    groups, model, opt = parallel_setup(1, 2, new_strategy, "allgather")
    assert resume_mode(saved_layout, {"dp": 1, "ep": 2, "pp": 1, "optimizer_sharding": new_strategy}) == "reshard"
    if groups.dp_rank == 0:
        ckpt_state.load_model(ckpt, _coords(groups, new_strategy), model)
    broadcast_model(model, groups)
    opt.sync_master_from_params()

    load_optimizer_resharded(ckpt, opt, saved_layout)
    losses, _ = parallel_steps(groups, model, opt, STOP_AT, STEPS - STOP_AT)
    return {"losses": losses, "params": _snapshot(model), "ep_rank": groups.ep_rank, "data_rank": groups.data_rank}


@pytest.mark.parametrize("saved_strategy,new_strategy", [("epso", "zero1"), ("zero1", "epso"), ("none", "epso")])
def test_checkpoint_from_dp2_ep2_loads_at_dp1_ep2(rank_pool, tmp_path, saved_strategy, new_strategy):
    reference = reference_run(STEPS)
    rank_pool.run(_save_worker, 4, str(tmp_path), saved_strategy)
    results = rank_pool.run(_reshard_worker, 2, str(tmp_path), saved_strategy, new_strategy)
    for r in results:
        accum = MICRO_BATCHES // 2
        expected = [sum(step[r["data_rank"] * accum : (r["data_rank"] + 1) * accum]) / accum
                    for step in reference["losses"][STOP_AT:]]
        assert r["losses"] == pytest.approx(expected, rel=1e-5)
        for name, p in r["params"].items():
            ref = reference["params"][name]
            if p.shape != ref.shape:
                e_local = p.shape[0]
                ref = ref[r["ep_rank"] * e_local : (r["ep_rank"] + 1) * e_local]
            torch.testing.assert_close(p, ref, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_shard_bookkeeping_is_consistent():
    # every shard of every bucket kind has exactly one designated holder, and that holder owns that shard
    for strategy in ("none", "zero1", "epso"):
        for dp, ep in ((1, 1), (2, 2), (1, 4), (4, 1), (3, 2)):
            for expert in (False, True):
                for ep_rank in range(ep) if expert else (0,):
                    _, count = shard_of(strategy, expert, 0, 0, dp, ep)
                    for i in range(count):
                        r = holder_of(strategy, expert, i, 0, ep_rank, dp, ep)
                        _, d, e = coords_of(r, dp, ep)
                        assert shard_of(strategy, expert, d, e, dp, ep) == (i, count)
                        assert not expert or e == ep_rank
    # DP-scattered model writes: shards 0..7 over dp=4 land on DP indices 0,1,2,3,0,1,2,3
    assert [model_shard_writer(m, 4) for m in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_resume_mode_of_each_layout_change():
    saved = {"dp": 2, "ep": 2, "pp": 1, "optimizer_sharding": "epso"}
    assert resume_mode(saved, dict(saved)) == "same"
    assert resume_mode(saved, {**saved, "dp": 4, "optimizer_sharding": "zero1"}) == "reshard"
    assert resume_mode(saved, {**saved, "ep": 4}) == resume_mode(saved, {**saved, "pp": 2}) == "relayout"


def _opt_tensors(opt) -> dict[str, torch.Tensor]:
    return {f"{b}.{k}": v for b, s in opt.state_dict()["buckets"].items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}


def _relayout_worker(rank: int, world: int, tmp: str, dp: int, ep: int, strategy: str, src: str, dst: str) -> dict:
    """Load `src` (written under another layout) at (dp, ep), save it as `dst` under this layout; `src` None: train
    STOP_AT steps from the start instead."""
    groups, model, opt = parallel_setup(dp, ep, strategy, "allgather")
    if src:
        ckpt = Path(tmp) / src
        saved_layout = ckpt_state.load_trainer_state(ckpt)["layout"]
        assert resume_mode(saved_layout, {"dp": dp, "ep": ep, "pp": 1, "optimizer_sharding": strategy}) == "relayout"
        relayout.load_model(ckpt, model, groups.ep_rank, groups.ep_size)
        opt.sync_master_from_params()
        relayout.load_optimizer(ckpt, opt, saved_layout)
    else:
        parallel_steps(groups, model, opt, 0, STOP_AT)
    _save(Path(tmp) / dst, groups, model, opt, strategy)
    return {"params": _snapshot(model), "opt": _opt_tensors(opt), "step": opt.step_count, "ep_rank": groups.ep_rank}


@pytest.mark.parametrize("strategy", ["none", "zero1"])
def test_ep2_checkpoint_resumes_at_ep1_and_back_bitwise(rank_pool, tmp_path, strategy):
    """EP=2 -> EP=1 -> EP=2: the EP=1 model is the EP=2 ranks' experts concatenated, and the state that comes back at
    EP=2 (model and every optimizer tensor of every rank) equals the original bitwise."""
    original = sorted(rank_pool.run(_relayout_worker, 2, str(tmp_path), 1, 2, strategy, "", "ep2"),
                      key=lambda r: r["ep_rank"])
    (single,) = rank_pool.run(_relayout_worker, 1, str(tmp_path), 1, 1, strategy, "ep2", "ep1")
    back = sorted(rank_pool.run(_relayout_worker, 2, str(tmp_path), 1, 2, strategy, "ep1", "ep2-again"),
                  key=lambda r: r["ep_rank"])
    for name, p in single["params"].items():
        parts = [r["params"][name] for r in original]
        assert torch.equal(p, parts[0] if parts[0].shape == p.shape else torch.cat(parts)), name
    assert single["step"] == original[0]["step"] == STOP_AT
    for before, after in zip(original, back):
        assert after["step"] == before["step"]
        for name, p in before["params"].items():
            assert torch.equal(after["params"][name], p), name
        assert before["opt"].keys() == after["opt"].keys()
        for key, t in before["opt"].items():
            assert torch.equal(after["opt"][key], t), key
