"""benchmarks/ep_train.py in its tiny CPU mode on 2 gloo ranks: the script's measurement functions run and report
what the GPU run will report (the numbers themselves mean nothing on CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from moe_launch.conf.schema import ParallelConfig
from moe_launch.trainer.parallel.groups import build_groups

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "ep_train.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("ep_train_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_worker(rank: int, world: int) -> dict:
    bench = _load_bench()
    args = bench.parse(["--cpu", "--steps", "1", "--warmup", "0", "--tokens", "64"])
    groups = build_groups(ParallelConfig(dp=1, ep=world))
    device = torch.device("cpu")
    return {"train": [bench.train_run(args, device, groups, s, "alltoall") for s in ("zero1", "epso")],
            "dispatch": [bench.dispatch_run(args, device, groups, d) for d in ("allgather", "alltoall")]}


def test_ep_train_cpu_mode_reports_every_measurement(rank_pool):
    results = rank_pool.run(_bench_worker, 2)
    zero1, epso = results[0]["train"]
    for r in (zero1, epso):
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and r["optimizer_ms"] > 0
    # EPSO shards the non-expert state over both EP ranks, ZeRO-1 (dp=1) cannot shard at all
    assert epso["optimizer_state_gib"] < zero1["optimizer_state_gib"]
    assert zero1["loss"] == epso["loss"]  # same model, same data: the first step's loss cannot depend on sharding
    for d in results[0]["dispatch"]:
        assert d["layer_fwd_bwd_ms"] > 0 and d["exchange_fwd_bwd_ms"] > 0
