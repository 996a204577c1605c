"""Pipeline-parallel training step benchmark: bubble fraction, tokens/s and peak memory per schedule.

On the device (2 GPUs, PP=2 of an 8-layer OLMoE-shaped model, bf16 autocast, fp32 weights):
    torchrun --nproc-per-node 2 benchmarks/pp_train.py --out $OUT
Tiny CPU mode (gloo, fp32, checks the script itself):
    torchrun --nproc-per-node 2 benchmarks/pp_train.py --cpu

Per schedule (gpipe, 1f1b, interleaved with 2 virtual stages): warm-up steps, then timed steps of forward + backward
of M micro-batches through the pipeline (no optimizer step: it does not depend on the schedule). Reported:
  tokens_per_s        global tokens of a step / median step time (slowest rank)
  bubble_measured     1 - busy / step time, from one extra step that synchronises the device around every compute
                      action (busy = sum of this stage's action times); the mean over stages
  bubble_theory       the same fraction from schedule.simulate with this run's mean forward / backward chunk times
                      (zero communication time, perfectly balanced stages: the schedule's own bubble)
  busy_s_per_stage    compute seconds of each stage in the timed step (their difference is stage imbalance)
  peak_mem_gib        torch.cuda.max_memory_allocated during the timed steps (max over ranks)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe_launch.conf.schema import ModelConfig, MoEConfig, ParallelConfig
from moe_launch.trainer.dist import detect_env, init_distributed, pick_device
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.pipeline import build_pipeline, pipeline_step
from moe_launch.trainer.pipeline.schedule import simulate
from moe_launch.trainer.recompute import apply_recompute
from moe_launch.trainer.tracking.flops import flops_per_token, mfu, spec_peak


def olmoe_8_layers(impl: str) -> ModelConfig:
    return ModelConfig(name="olmoe-8l", kind="moe", vocab_size=50304, d_model=2048, n_layers=8, n_heads=16,
                       max_seq_len=4096, moe=MoEConfig(num_experts=64, top_k=8, expert_hidden=1024, impl=impl))


def tiny() -> ModelConfig:
    return ModelConfig(name="tiny", kind="moe", vocab_size=256, d_model=64, n_layers=4, n_heads=4, max_seq_len=64,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=64))


def run_schedule(model_cfg: ModelConfig, schedule: str, virtual: int, args, device: torch.device) -> dict:
    pcfg = ParallelConfig(pp=2, pp_schedule=schedule, pp_virtual_stages=virtual, microbatches=args.microbatches,
                          pp_balance=args.balance)
    groups = build_groups(pcfg)
    torch.manual_seed(0)
    pipe = build_pipeline(model_cfg, pcfg, groups, device)
    apply_recompute(pipe.model, args.recompute)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    g = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, model_cfg.vocab_size, (args.mbs, args.seq + 1), generator=g).to(device)
           for _ in range(args.microbatches)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(timings=None) -> float:
        pipe.model.zero_grad(set_to_none=True)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        pipeline_step(pipe, mbs, autocast_dtype=autocast, timings=timings)
        sync()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's step time
        return float(dt)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [step() for _ in range(args.steps)]
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                        device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)

    timings: list = []
    wall = step(timings)
    busy = sum(end - start for _, start, end in timings)
    fwd = [e - s for a, s, e in timings if a.kind == "F"]
    bwd = [e - s for a, s, e in timings if a.kind == "B"]
    stats = torch.tensor([1.0 - busy / wall, statistics.mean(fwd), statistics.mean(bwd), busy], dtype=torch.float64,
                         device=device)
    per_rank = [torch.zeros_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(per_rank, stats)
    bubble_measured, t_f, t_b = (float(v) for v in torch.stack(per_rank).mean(0)[:3])
    busy_per_stage = [float(r[3]) for r in per_rank]
    theory = simulate(pipe.orders(args.microbatches), t_fwd=t_f, t_bwd=t_b, virtual=virtual)
    tokens = args.microbatches * args.mbs * args.seq
    median = statistics.median(times)
    chunk_layers = [len(r) for r in pipe.chunk_ranges]
    return {"schedule": schedule, "virtual_stages": virtual, "microbatches": args.microbatches, "mbs": args.mbs,
            "seq": args.seq, "step_s_median": median, "step_s_all": times, "tokens_per_s": tokens / median,
            "mfu_spec": mfu(tokens / median / dist.get_world_size(), flops_per_token(model_cfg, args.seq),
                            spec_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None),
            "bubble_measured": bubble_measured, "bubble_theory": theory.bubble_fraction,
            "chunk_fwd_ms": 1e3 * t_f, "chunk_bwd_ms": 1e3 * t_b, "peak_mem_gib": float(peak),
            "busy_s_per_stage": busy_per_stage, "timed_step_s": wall, "balance": args.balance,
            "chunk_layers": chunk_layers,
            "recompute": list(args.recompute)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny fp32 model on CPU with gloo (script check)")
    ap.add_argument("--microbatches", type=int, default=None)
    ap.add_argument("--mbs", type=int, default=None, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--impl", default="fast", help="model.moe.impl on GPU: fast | reference")
    ap.add_argument("--recompute", nargs="*", default=[], help="train.recompute kinds, e.g. norm attention moe")
    ap.add_argument("--balance", default="params", help="parallel.pp_balance: flops | params | layers")
    ap.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--out", default=None, help="directory for pp_train.json")
    args = ap.parse_args()
    defaults = dict(microbatches=4, mbs=2, seq=32, steps=2, warmup=1) if args.cpu else \
        dict(microbatches=8, mbs=1, seq=4096, steps=5, warmup=2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    env = detect_env(os.environ)
    if args.cpu:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        device = pick_device(env)
    init_distributed(env, device)
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc-per-node 2 (PP=2)")
    model_cfg = tiny() if args.cpu else olmoe_8_layers(args.impl)
    rows = []
    for schedule in args.schedules:
        row = run_schedule(model_cfg, schedule, 2 if schedule == "interleaved" else 1, args, device)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the previous schedule's stage is garbage now
        if env.rank == 0:
            print(json.dumps(row), flush=True)
    if env.rank == 0:
        meta = {"model": model_cfg.name, "torch": torch.__version__, "device": torch.cuda.get_device_name(device)
                if device.type == "cuda" else "cpu", "world": 2, "time": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                          time.gmtime())}
        print(f"\n{meta}\n| schedule | layers per chunk | M | tokens/s | MFU vs spec per GPU | step s "
              "| bubble measured | bubble theory "
              "| busy s per stage | chunk F/B ms | peak GiB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            name = r["schedule"] + (f" (v={r['virtual_stages']})" if r["virtual_stages"] > 1 else "")
            busy = " / ".join(f"{b:.3f}" for b in r["busy_s_per_stage"])
            spec = "-" if r["mfu_spec"] is None else f"{r['mfu_spec']:.1%}"
            print(f"| {name} | {r['chunk_layers']} | {r['microbatches']} | {r['tokens_per_s']:.0f} | {spec} | "
                  f"{r['step_s_median']:.3f} | {r['bubble_measured']:.3f} | {r['bubble_theory']:.3f} | {busy} | "
                  f"{r['chunk_fwd_ms']:.1f} / "
                  f"{r['chunk_bwd_ms']:.1f} | {r['peak_mem_gib']:.1f} |")
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "pp_train.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
