"""PP=2 x DP=2 with ZeRO-1 (4 gloo ranks): three steps equal the unpipelined model's; stage-sharded checkpoints resume
to the same next step as not stopping; model shards are written scattered over the DP ranks; a model-only load
works into another PP layout."""

from __future__ import annotations

import pytest
import torch
from pp_harness import spawn
from pp_training import SEED, TRAIN, M, lr_at, micro_batches, model_cfg, reference_run

from moe_launch.conf.schema import ParallelConfig
from moe_launch.trainer.checkpoint import state as ckpt
from moe_launch.trainer.checkpoint.layout import Coords
from moe_launch.trainer.checkpoint.store import read_manifest, verify
from moe_launch.trainer.dist import Comm
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import build_optimizer
from moe_launch.trainer.pipeline import build_pipeline, pipeline_step
from moe_launch.trainer.pipeline.stage import build_stage_model

PCFG = ParallelConfig(dp=2, pp=2, pp_schedule="1f1b", microbatches=M, optimizer_sharding="zero1")


def _step(pipe, opt, groups, step: int) -> float:
    mbs = micro_batches(step, groups.data_size)[groups.data_rank * M : (groups.data_rank + 1) * M]
    loss, _ = pipeline_step(pipe, mbs)
    opt.reduce_grads()
    opt.clip_grad_norm_(TRAIN.grad_clip)
    opt.step(lr_at(step))
    opt.zero_grad()
    return loss.item()


def _worker(rank: int, world: int, path: str) -> dict:
    groups = build_groups(PCFG)
    coords = Coords.of(groups, PCFG.optimizer_sharding, is_moe=True)

    def fresh(seed: int):
        torch.manual_seed(seed)
        pipe = build_pipeline(model_cfg(), PCFG, groups)
        return pipe, build_optimizer(pipe.model, TRAIN, PCFG, groups)

    pipe, opt = fresh(SEED)
    losses = [_step(pipe, opt, groups, step) for step in range(2)]
    saved = {n: p.detach().clone() for n, p in pipe.model.named_parameters()}
    ckpt.save(path, 2, coords, pipe.model, opt, {"step": 2}, Comm(), torch.device("cpu"))
    straight = (_step(pipe, opt, groups, 2), {n: p.detach().clone() for n, p in pipe.model.named_parameters()})

    pipe, opt = fresh(SEED + 1)  # other weights: the load must replace all of them
    ckpt.load_model(path, coords, pipe.model)
    ckpt.load_optimizer(path, coords, opt)
    resumed = (_step(pipe, opt, groups, 2), {n: p.detach().clone() for n, p in pipe.model.named_parameters()})
    return {"saved": saved, "straight": straight, "resumed": resumed, "losses": losses + [straight[0]],
            "data_rank": groups.data_rank}


def test_stage_checkpoint_resume_scatter_and_relayout(tmp_path):
    path = tmp_path / "ckpt-a"
    results = spawn(_worker, 4, str(path))
    reference = reference_run(3, data_size=2)
    for r in results:  # DP x PP composes: the same losses and weights as one process
        assert r["losses"] == pytest.approx([s[r["data_rank"]] for s in reference["losses"]], rel=1e-5)
        for name, p in r["straight"][1].items():
            torch.testing.assert_close(p, reference["params"][name], rtol=1e-4, atol=1e-5)
    for r in results:
        assert r["resumed"][0] == r["straight"][0]
        for name, p in r["straight"][1].items():
            assert torch.equal(r["resumed"][1][name], p), name

    assert verify(path)[0]
    writers = {rel: info["rank"] for rel, info in read_manifest(path)["files"].items()}
    # rank = (pp * dp + dp_rank) * ep + ep_rank: stage 0 = ranks 0, 1 (dp 0, 1); stage 1 = ranks 2, 3
    # shards m = 0 (pp0 experts), 1 (pp0 dense), 2 (pp1 experts), 3 (pp1 dense) go to dp rank m % 2
    assert {rel: w for rel, w in writers.items() if rel.startswith("model/")} == {
        "model/pp0/experts-ep0.pt": 0, "model/pp0/dense.pt": 1, "model/pp1/experts-ep0.pt": 2,
        "model/pp1/dense.pt": 3}
    assert {f"optim/rank{r}.pt" for r in range(4)} <= writers.keys() and writers["trainer.pt"] == 0

    # the PP=2 model-only files load into an unpipelined (one stage, one chunk) model
    cfg = model_cfg()
    torch.manual_seed(123)
    whole = build_stage_model(cfg, {0: range(cfg.n_layers)}, 1)
    groups = build_groups(ParallelConfig())
    ckpt.load_model(path, Coords.of(groups, "none", is_moe=True), whole)
    saved = {**results[0]["saved"], **results[2]["saved"]}
    assert saved.keys() == dict(whole.named_parameters()).keys()
    for name, p in whole.named_parameters():
        assert torch.equal(p, saved[name]), name


def _relayout_worker(rank: int, world: int, tmp: str, pp: int, src: str, dst: str) -> dict:
    """At (dp=1, pp): train two steps (`src` empty) or load `src`, written under another PP split; save as `dst`."""
    from pathlib import Path

    from moe_launch.trainer.checkpoint import relayout
    from moe_launch.trainer.checkpoint.resume import resume_mode

    pcfg = ParallelConfig(pp=pp, pp_schedule="1f1b", microbatches=M * 2, optimizer_sharding="none")
    groups = build_groups(pcfg)
    torch.manual_seed(SEED)
    if pp > 1:
        pipe = build_pipeline(model_cfg(), pcfg, groups)
        model = pipe.model
    else:
        cfg = model_cfg()
        model = build_stage_model(cfg, {0: range(cfg.n_layers)}, 1)
    opt = build_optimizer(model, TRAIN, pcfg, groups)
    if src:
        saved_layout = ckpt.load_trainer_state(Path(tmp) / src)["layout"]
        assert resume_mode(saved_layout, {"dp": 1, "ep": 1, "pp": pp, "optimizer_sharding": "none"}) == "relayout"
        relayout.load_model(Path(tmp) / src, model, 0, 1)
        opt.sync_master_from_params()
        relayout.load_optimizer(Path(tmp) / src, opt, saved_layout)
    else:
        for step in range(2):
            pipeline_step(pipe, micro_batches(step, 1)[: M * 2])
            opt.reduce_grads()
            opt.step(lr_at(step))
            opt.zero_grad()
    layout = {"dp": 1, "ep": 1, "pp": pp, "optimizer_sharding": "none"}
    ckpt.save(Path(tmp) / dst, 2, Coords.of(groups, "none", is_moe=True), model, opt, {"layout": layout}, Comm(),
              torch.device("cpu"))
    sd = opt.state_dict()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "step": opt.step_count,
            "opt": {f"{b}.{k}": v for b, s in sd["buckets"].items() for k, v in s.items() if torch.is_tensor(v)}}


def test_pp2_checkpoint_resumes_at_pp1_and_back_bitwise(tmp_path):
    """PP=2 -> PP=1 -> PP=2: the PP=1 model holds both stages' parameters, and what comes back at PP=2 (parameters
    and every optimizer tensor of both stages) equals the original bitwise."""
    original = spawn(_relayout_worker, 2, str(tmp_path), 2, "", "pp2")
    (whole,) = spawn(_relayout_worker, 1, str(tmp_path), 1, "pp2", "pp1")
    back = spawn(_relayout_worker, 2, str(tmp_path), 2, "pp1", "pp2-again")
    stages = {**original[0]["params"], **original[1]["params"]}
    assert whole["params"].keys() == stages.keys() and whole["step"] == 2
    for name, p in whole["params"].items():
        assert torch.equal(p, stages[name]), name
    for before, after in zip(original, back):
        assert after["step"] == before["step"] == 2 and before["opt"].keys() == after["opt"].keys()
        for name, p in before["params"].items():
            assert torch.equal(after["params"][name], p), name
        for key, t in before["opt"].items():
            assert torch.equal(after["opt"][key], t), key
