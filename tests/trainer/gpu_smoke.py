"""Manual GPU check of the Trainer (not collected by pytest; CI has no GPU).

    python tests/trainer/gpu_smoke.py OUT [--steps N] [--deterministic] [--dp 2]   (torchrun --nproc-per-node 2 ...)

Trains tiny_moe (seq 128) with bf16 autocast over fp32 master weights, on NCCL when launched by torchrun, and prints
the first/last losses and the step time. Builds the RootConfig directly, so it needs no OmegaConf on the GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from moe_launch.conf.presets import MODELS
from moe_launch.conf.schema import ClusterConfig, DataConfig, ParallelConfig, RootConfig, TrainConfig
from moe_launch.rundir import RunDir, read_jsonl
from moe_launch.trainer.dist import detect_env, init_distributed, pick_device, shutdown
from moe_launch.trainer.loop import Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--name", default="run")
    ap.add_argument("--model", default="tiny_moe", help="a preset of conf/presets.py")
    ap.add_argument("--layers", type=int, default=0, help="override n_layers (0: the preset's)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--impl", default="reference")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ckpt", type=int, default=20, help="train.ckpt_interval (0: no checkpoints)")
    args = ap.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env = detect_env(os.environ)
    device = pick_device(env)
    init_distributed(env, device)
    model = replace(MODELS[args.model], n_layers=args.layers or MODELS[args.model].n_layers)
    model.moe = replace(model.moe, impl=args.impl)
    cfg = RootConfig(
        model=model, parallel=ParallelConfig(dp=args.dp),
        train=TrainConfig(steps=args.steps, global_batch_size=args.batch, micro_batch_size=args.micro,
                          seq_len=args.seq, ckpt_interval=args.ckpt, deterministic=args.deterministic, progress=False,
                          compile=args.compile),
        data=DataConfig(cache_dir=str(args.out / "cache"), workers=8), cluster=ClusterConfig(nodes=args.dp),
    )
    rd = RunDir(args.out / args.name)
    t0 = time.perf_counter()
    code = Trainer(cfg, rd, device=device).train()
    if env.rank == 0:
        m = read_jsonl(rd.metrics)
        print(json.dumps({"name": args.name, "exit": code, "device": torch.cuda.get_device_name(device),
                          "first_loss": m[0]["loss"], "last_loss": m[-1]["loss"],
                          "losses": [round(r["loss"], 4) for r in m][:: max(1, len(m) // 10)],
                          "wall_s": time.perf_counter() - t0,
                          "median_tokens_per_s": sorted(r["tokens_per_s"] for r in m)[len(m) // 2],
                          "max_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}))
    shutdown()


if __name__ == "__main__":
    main()
