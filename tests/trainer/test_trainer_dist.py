"""The real entry point on two gloo ranks: DP=2 equals DP=1, and a NaN on rank 1 is a soft fault naming its node."""

import json

import torch
from trainer_harness import launch_ranks, tiny_cfg, write_run

from moe_launch.conf.schema import FaultInjection
from moe_launch.rundir import EXIT_OK, EXIT_SOFT_FAULT, read_jsonl
from moe_launch.trainer.checkpoint.store import choose_resume_slot, read_manifest
from moe_launch.trainer.loop import Trainer

torch.set_num_threads(1)


def test_dp2_matches_dp1_with_the_same_global_batch(tmp_path, data_cache):
    one = write_run(tmp_path / "dp1", tiny_cfg(data_cache, steps=4, ckpt_interval=4))
    assert Trainer(tiny_cfg(data_cache, steps=4, ckpt_interval=4), one).train() == EXIT_OK
    two = write_run(tmp_path / "dp2", tiny_cfg(data_cache, dp=2, steps=4, ckpt_interval=4))
    procs = launch_ranks(two, world=2)
    assert [p.returncode for p in procs] == [EXIT_OK, EXIT_OK], procs[0].stdout[-3000:] + procs[1].stdout[-3000:]

    m1, m2 = read_jsonl(one.metrics), read_jsonl(two.metrics)
    assert [r["step"] for r in m2] == [1, 2, 3, 4]
    for a, b in zip(m1, m2):
        for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a, b)
        # expert load counts every data rank's tokens: the same global batch routes the same (token, slot) pairs
        assert a["expert_counts"] == b["expert_counts"], (a["expert_counts"], b["expert_counts"])
    assert "[node0 r0] step 4/4 | loss" in procs[0].stdout  # the plain log line, with the rank/node prefix
    # the checkpoint is written scattered: each rank its own RNG file; the model (shard m = 1 at EP=1) by DP index
    # 1 mod 2 = rank 1 (DP-scattered writes), the trainer state by rank 0
    manifest = read_manifest(choose_resume_slot(two.checkpoints).path)
    writers = {rel: info["rank"] for rel, info in manifest["files"].items()}
    assert writers["rng/rank1.pt"] == 1 and writers["rng/rank0.pt"] == 0 and writers["model/dense.pt"] == 1
    assert writers["trainer.pt"] == 0
    beats = {r: json.loads((two.heartbeat / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert beats[0]["step"] == beats[1]["step"] == 4 and beats[1]["host"] == "node1"


def test_nan_on_rank1_at_step5_is_a_soft_fault(tmp_path, data_cache):
    cfg = tiny_cfg(data_cache, dp=2, steps=8, ckpt_interval=2,
                   fault_injection=FaultInjection(kind="nan", rank=1, step=5, attempt=0))
    rd = write_run(tmp_path / "run", cfg)
    procs = launch_ranks(rd, world=2)
    assert [p.returncode for p in procs] == [EXIT_SOFT_FAULT] * 2, procs[0].stdout[-3000:] + procs[1].stdout[-3000:]

    records = sorted(p.name for p in rd.faults.iterdir())
    assert records == ["node1-rank1-step5.json"]
    record = json.loads((rd.faults / records[0]).read_text())
    assert (record["host"], record["rank"], record["step"]) == ("node1", 1, 5) and "loss" in record["what"]
    # nothing after the fault: the newest checkpoint is step 4, no metrics or heartbeat beyond step 4
    assert choose_resume_slot(rd.checkpoints).step == 4
    assert max(r["step"] for r in read_jsonl(rd.metrics)) == 4
    assert max(e["details"]["step"] for e in read_jsonl(rd.journal) if e["kind"] == "checkpoint") == 4
    assert json.loads((rd.heartbeat / "rank0.json").read_text())["step"] == 4
    fault = [e for e in read_jsonl(rd.journal) if e["kind"] == "fault"]
    assert len(fault) == 1 and fault[0]["nodes"] == ["node1"] and fault[0]["details"]["ranks"] == [1]
    # attempt 1 resumes from step 4 and the injection (attempt 0 only) does not fire again
    procs = launch_ranks(rd, world=2, attempt=1)
    assert [p.returncode for p in procs] == [EXIT_OK] * 2, procs[0].stdout[-3000:]
    assert max(r["step"] for r in read_jsonl(rd.metrics)) == 8


def test_ep2_zero1_trainer_matches_dp1_and_resumes_bitwise(tmp_path, data_cache):
    """EP=2 through the Trainer: losses equal DP=1 (fp32 tolerance), each EP rank writes its own expert shard, and
    a crash-resume from that sharded checkpoint continues bitwise like the uninterrupted EP run."""
    ref = write_run(tmp_path / "dp1", tiny_cfg(data_cache, steps=6))
    assert Trainer(tiny_cfg(data_cache, steps=6), ref).train() == EXIT_OK
    ep = write_run(tmp_path / "ep2", tiny_cfg(data_cache, ep=2, optimizer_sharding="zero1", steps=6))
    procs = launch_ranks(ep, world=2)
    assert [p.returncode for p in procs] == [EXIT_OK] * 2, procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    for a, b in zip(read_jsonl(ref.metrics), read_jsonl(ep.metrics)):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
    # the first step routes the same tokens with the same router: the load counts both EP ranks' tokens
    assert read_jsonl(ref.metrics)[0]["expert_counts"] == read_jsonl(ep.metrics)[0]["expert_counts"]

    crashed = write_run(tmp_path / "ep2-crash", tiny_cfg(
        data_cache, ep=2, optimizer_sharding="zero1", steps=6,
        fault_injection=FaultInjection(kind="crash", rank=1, step=5, attempt=0)))
    procs = launch_ranks(crashed, world=2)
    assert procs[1].returncode == 1 and "InjectedCrash" in procs[1].stdout
    manifest = read_manifest(choose_resume_slot(crashed.checkpoints).path)
    assert manifest["step"] == 4
    writers = {rel: info["rank"] for rel, info in manifest["files"].items()}
    assert writers["model/experts-ep0.pt"] == 0 and writers["model/experts-ep1.pt"] == 1
    assert writers["optim/rank0.pt"] == 0 and writers["optim/rank1.pt"] == 1
    procs = launch_ranks(crashed, world=2, attempt=1)
    assert [p.returncode for p in procs] == [EXIT_OK] * 2, procs[0].stdout[-3000:]
    resumed = {r["step"]: r["loss"] for r in read_jsonl(crashed.metrics)}
    assert [resumed[s] for s in (5, 6)] == [r["loss"] for r in read_jsonl(ep.metrics)][4:6]
