"""The Trainer under pipeline parallelism, through the real entry point (`python -m moe_launch.trainer`, 2 gloo ranks):
PP=2 gives the losses, aux / z losses and gradient norms of PP=1; checkpoints are stage-sharded; a crash-resume
continues bitwise like the uninterrupted PP=2 run; a NaN on one stage is a soft fault of that rank only."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))  # the trainer tests' harness
from trainer_harness import launch_ranks, tiny_cfg, write_run  # noqa: E402

from moe_launch.conf.schema import FaultInjection, ParallelConfig, RootConfig  # noqa: E402
from moe_launch.rundir import EXIT_OK, EXIT_SOFT_FAULT, read_jsonl  # noqa: E402
from moe_launch.trainer.checkpoint.store import choose_resume_slot, read_manifest  # noqa: E402
from moe_launch.trainer.loop import Trainer  # noqa: E402

torch.set_num_threads(1)

BATCH = dict(global_batch_size=8, micro_batch_size=2)  # 4 micro-batches through the pipeline per step


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data-cache"))


def pp_cfg(data_cache: str, schedule: str = "1f1b", optimizer_sharding: str = "none", **train) -> RootConfig:
    fault = train.pop("fault_injection", FaultInjection())  # rank 1 exists only once the world has 2 ranks
    base = tiny_cfg(data_cache, **BATCH, **train)
    return replace(base, parallel=ParallelConfig(pp=2, pp_schedule=schedule, microbatches=4,
                                                 optimizer_sharding=optimizer_sharding),
                   cluster=replace(base.cluster, nodes=2), train=replace(base.train, fault_injection=fault))


def _ok(procs) -> None:
    assert [p.returncode for p in procs] == [EXIT_OK] * len(procs), "\n".join(p.stdout[-3000:] for p in procs)


def _losses(rd, after: int = 0) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(rd.metrics) if r["step"] > after}  # later lines win


@pytest.mark.slow  # ~1 min alone (four 2-rank launches of the entry point), several on a loaded machine
def test_pp2_trainer_matches_pp1_and_resumes_bitwise(tmp_path, data_cache):
    ref = write_run(tmp_path / "pp1", tiny_cfg(data_cache, steps=6, model_ckpt_interval=4, **BATCH))
    assert Trainer(tiny_cfg(data_cache, steps=6, model_ckpt_interval=4, **BATCH), ref).train() == EXIT_OK
    pp = write_run(tmp_path / "pp2", pp_cfg(data_cache, steps=6, model_ckpt_interval=4))
    procs = launch_ranks(pp, world=2)
    _ok(procs)
    assert "pp=2" in procs[0].stdout

    m1, m2 = read_jsonl(ref.metrics), read_jsonl(pp.metrics)
    assert [r["step"] for r in m2] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(m1, m2):
        # the global norm covers both stages' parameters once; clipping (grad_clip) depends on it
        for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a, b)
        assert b["aux_per_layer"] == pytest.approx(a["aux_per_layer"], rel=1e-5)  # every stage's layers reported
        assert b["expert_load_max"] == pytest.approx(a["expert_load_max"], rel=1e-6)

    # stage-sharded checkpoint: each stage writes its own model and optimizer files (dp=1: both on the stage's rank)
    manifest = read_manifest(choose_resume_slot(pp.checkpoints).path)
    writers = {rel: info["rank"] for rel, info in manifest["files"].items()}
    for stage in (0, 1):
        assert writers[f"model/pp{stage}/dense.pt"] == stage
        assert writers[f"model/pp{stage}/experts-ep0.pt"] == stage
        assert writers[f"optim/pp{stage}-ep0.pt"] == stage
    assert writers["trainer.pt"] == 0

    # a model-only checkpoint of the PP=2 run starts a PP=1 run like the PP=1 run's own (the names are the full
    # model's in both layouts)
    first = {}
    for name, rd in (("pp1", ref), ("pp2", pp)):
        cfg = tiny_cfg(data_cache, steps=5, ckpt_interval=0, **BATCH)  # one step after the checkpoint's
        cfg = replace(cfg, model=replace(cfg.model, init_from=f"ckpt:{rd.checkpoints / 'model-step-4'}"))
        run = write_run(tmp_path / f"from-{name}", cfg)
        assert Trainer(cfg, run).train() == EXIT_OK
        first[name] = read_jsonl(run.metrics)[0]["loss"]
    assert first["pp2"] == pytest.approx(first["pp1"], rel=1e-5)

    crashed = write_run(tmp_path / "pp2-crash", pp_cfg(
        data_cache, steps=6, fault_injection=FaultInjection(kind="crash", rank=1, step=5, attempt=0)))
    procs = launch_ranks(crashed, world=2)
    assert procs[1].returncode == 1 and "InjectedCrash" in procs[1].stdout, procs[1].stdout[-3000:]
    assert choose_resume_slot(crashed.checkpoints).step == 4
    # the same step-4 checkpoint resumed with another optimizer_sharding: the stage files optim/pp<p>-ep0.pt are
    # reassembled into ZeRO-1 shards (trainer/checkpoint/resume.py)
    zero1 = write_run(tmp_path / "pp2-zero1", pp_cfg(data_cache, steps=6, optimizer_sharding="zero1"))
    shutil.copytree(crashed.checkpoints, zero1.checkpoints, dirs_exist_ok=True)
    _ok(launch_ranks(crashed, world=2, attempt=1))
    resumed, straight = _losses(crashed, after=4), _losses(pp)
    assert [resumed[s] for s in (5, 6)] == [straight[s] for s in (5, 6)]  # bitwise

    _ok(launch_ranks(zero1, world=2, attempt=1))
    resharded = _losses(zero1, after=4)
    assert [resharded[s] for s in (5, 6)] == pytest.approx([straight[s] for s in (5, 6)], rel=1e-6)
    event = [e for e in read_jsonl(zero1.journal) if e["kind"] == "resume"][-1]
    assert event["details"]["step"] == 4 and event["details"]["resharded"] is True


def test_nan_on_the_last_stage_is_a_soft_fault_of_that_rank(tmp_path, data_cache):
    cfg = pp_cfg(data_cache, schedule="gpipe", steps=4, ckpt_interval=2,
                 fault_injection=FaultInjection(kind="nan", rank=1, step=3, attempt=0))
    rd = write_run(tmp_path / "run", cfg)
    procs = launch_ranks(rd, world=2)
    assert [p.returncode for p in procs] == [EXIT_SOFT_FAULT] * 2, "\n".join(p.stdout[-3000:] for p in procs)
    # only the injecting rank reports, although both stages share the pipeline's loss
    assert sorted(p.name for p in rd.faults.iterdir()) == ["node1-rank1-step3.json"]
    assert choose_resume_slot(rd.checkpoints).step == 2
    assert max(r["step"] for r in read_jsonl(rd.metrics)) == 2


def test_resharding_reads_the_optimizer_files_the_stages_wrote():
    """Pure: for every saved layout, the file resume.py reads for a saved rank is one that some rank wrote."""
    from moe_launch.trainer.checkpoint import layout as ckpt_layout
    from moe_launch.trainer.checkpoint.resume import saved_optimizer_file, saved_rank_coords

    for strategy in ("none", "zero1", "epso"):
        for dp, ep, pp in ((1, 1, 2), (2, 1, 2), (2, 2, 2), (1, 2, 4)):
            layout = {"dp": dp, "ep": ep, "pp": pp, "optimizer_sharding": strategy}
            written = {rel for rank in range(dp * ep * pp)
                       for rel in ckpt_layout.writes(saved_rank_coords(rank, layout))}
            for rank in range(dp * ep * pp):
                assert saved_optimizer_file(rank, layout) in written, (layout, rank)
