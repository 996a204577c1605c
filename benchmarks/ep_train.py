"""Expert-parallel training benchmark: EP=2 training of a 4-layer OLMoE-shaped model.

On 2 GPUs:   PYTHONUNBUFFERED=1 torchrun --nproc-per-node 2 benchmarks/ep_train.py --out $OUT
CPU smoke:   python benchmarks/ep_train.py --cpu          (spawns 2 gloo ranks itself; tiny dims; checks the script)

Measures, per rank (EP group = all ranks, dp = 1):
  1. training throughput (forward + backward + gradient reduction + clip + AdamW) for each optimizer sharding
     (zero1: state replicated over EP since dp = 1; epso: non-expert state sharded over DP x EP) and each token
     exchange (allgather | alltoall): tokens/s over the EP group, ms/step, peak memory per GPU;
  2. the optimizer step alone (reduce_grads + clip_grad_norm_ + step), median ms, EPSO vs ZeRO-1;
  3. one MoE layer forward + backward at --tokens tokens per rank with each dispatcher (median ms), same router and
     tokens; and the exchange alone (experts replaced by a near-free stand-in). Note the traffic: allgather sends
     each token once to every EP rank, alltoall sends one row per (token, expert) pair (top-8: up to 8 rows).
Model: OLMoE-1B-7B dims (d 2048, 16 heads, 64 experts, top-8, expert FFN 1024, vocab 50304), 4 layers, fp32
parameters + bf16 autocast (default) or bf16 parameters with the fp32 master in the optimizer (--bf16-params), attention
+ norms compiled with --compile, realistic (not forced-uniform) routing from a random router.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe_launch.conf.schema import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_launch.trainer.compile import compile_model
from moe_launch.trainer.dtypes import cast_parameters
from moe_launch.trainer.model import build_model
from moe_launch.trainer.parallel.dispatch import attach_dispatchers, make_dispatcher
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import build_optimizer
from moe_launch.trainer.tracking.flops import flops_per_token, mfu, spec_peak


def model_cfg(args, dispatcher: str) -> ModelConfig:
    if args.cpu:
        return ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, max_seq_len=64,
                           moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, dispatcher=dispatcher))
    return ModelConfig(vocab_size=50304, d_model=2048, n_layers=4, n_heads=16, max_seq_len=args.seq,
                       moe=MoEConfig(num_experts=64, top_k=8, expert_hidden=1024, dispatcher=dispatcher,
                                     impl=args.impl))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: timing needs the GPU idle


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def train_run(args, device, groups, strategy: str, dispatcher: str) -> dict:
    reset_peak(device)
    torch.manual_seed(0)
    cfg = model_cfg(args, dispatcher)
    model = build_model(cfg, groups.ep_rank, groups.ep_size, device)
    attach_dispatchers(model, cfg, groups)
    if args.bf16_params:  # as train.param_dtype=bf16: parameters only (rotary buffers stay fp32)
        cast_parameters(model, torch.bfloat16)
    if args.compile:
        compile_model(model)
    pcfg = ParallelConfig(dp=1, ep=groups.ep_size, optimizer_sharding=strategy)
    opt = build_optimizer(model, TrainConfig(), pcfg, groups)
    g = torch.Generator().manual_seed(100 + groups.data_rank)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    step_ms, opt_ms = [], []
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
        sync(device)
        t0 = time.perf_counter()
        with autocast:
            loss, _ = model.compute_loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        sync(device)
        t1 = time.perf_counter()
        opt.reduce_grads()
        opt.clip_grad_norm_(1.0)
        opt.step(1e-4)
        opt.zero_grad()
        sync(device)
        t2 = time.perf_counter()
        if i >= args.warmup:
            step_ms.append((t2 - t0) * 1e3)
            opt_ms.append((t2 - t1) * 1e3)
    step = statistics.median(step_ms)
    out = {
        "strategy": strategy, "dispatcher": dispatcher, "ms_per_step": step, "optimizer_ms": statistics.median(opt_ms),
        "tokens_per_s": args.batch * args.seq * groups.data_size / (step / 1e3),
        # one GPU's tokens over its data-sheet bf16 peak (None off CUDA)
        "mfu_spec": mfu(args.batch * args.seq / (step / 1e3), flops_per_token(cfg, args.seq),
                        spec_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None),
        "peak_gib": peak_gib(device), "optimizer_state_gib": opt.optimizer_state_bytes() / 2**30,
        "params_local": sum(p.numel() for p in model.parameters()), "loss": loss.item(),
    }
    del model, opt
    return out


def scale_only_experts(x_TD, idx_TK, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, e_start=0):
    """Near-free stand-in for the experts (y = x * sum of the local pairs' weights), so that the timing of a
    dispatcher with it is the token exchange alone, forward and backward."""
    E = w_gate_EFD.shape[0]
    local_TK = (idx_TK >= e_start) & (idx_TK < e_start + E)
    return x_TD * (w_TK * local_TK).sum(-1, keepdim=True).to(x_TD.dtype)


def dispatch_run(args, device, groups, dispatcher: str) -> dict:
    """One MoE layer fwd+bwd on `args.tokens` tokens per rank (router, exchange, experts, exchange back), then the
    same with the experts replaced by `scale_only_experts`: the exchange's own cost."""
    torch.manual_seed(0)
    cfg = model_cfg(args, dispatcher)
    layer = build_model(cfg, groups.ep_rank, groups.ep_size, device).blocks[0].ffn
    layer.dispatcher = make_dispatcher(dispatcher, groups.ep)
    g = torch.Generator().manual_seed(7 + groups.ep_rank)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, args.tokens, cfg.d_model, generator=g).to(device, dtype).requires_grad_()
    out = {"dispatcher": dispatcher, "tokens_per_rank": args.tokens}
    for label, experts_fn in (("layer_fwd_bwd_ms", layer.experts_fn), ("exchange_fwd_bwd_ms", scale_only_experts)):
        layer.experts_fn = experts_fn
        times = []
        for i in range(args.warmup + args.steps):
            sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                y, _ = layer(x)
            y.float().square().mean().backward()
            sync(device)
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        out[label] = statistics.median(times)
    return out


def main_rank(args) -> None:
    device = torch.device("cpu")
    if not args.cpu:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    groups = build_groups(ParallelConfig(dp=1, ep=world))
    results: dict = {"world": world, "bf16_params": args.bf16_params, "compile": args.compile,
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "batch": args.batch, "seq": args.seq, "train": [], "dispatch": []}
    for dispatcher in args.dispatchers:
        for strategy in args.strategies:
            r = train_run(args, device, groups, strategy, dispatcher)
            results["train"].append(r)
            if groups.world_rank == 0:
                print(f"[train] {dispatcher:9s} {strategy:5s} {r['ms_per_step']:8.1f} ms/step "
                      f"{r['tokens_per_s']:10.0f} tok/s  MFU vs spec per GPU "
                      f"{'-' if r['mfu_spec'] is None else format(r['mfu_spec'], '.1%')}  "
                      f"optimizer {r['optimizer_ms']:7.2f} ms  "
                      f"peak {r['peak_gib'] or 0:.1f} GiB  state {r['optimizer_state_gib']:.2f} GiB", flush=True)
    for dispatcher in args.dispatchers:
        r = dispatch_run(args, device, groups, dispatcher)
        results["dispatch"].append(r)
        if groups.world_rank == 0:
            print(f"[dispatch] {dispatcher:9s} {args.tokens} tokens/rank: MoE layer fwd+bwd "
                  f"{r['layer_fwd_bwd_ms']:.2f} ms, exchange alone fwd+bwd {r['exchange_fwd_bwd_ms']:.2f} ms",
                  flush=True)
    peaks = [None] * world
    dist.all_gather_object(peaks, [r["peak_gib"] for r in results["train"]])
    results["peak_gib_per_rank"] = peaks
    if groups.world_rank == 0 and args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ep_train.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    main_rank(args)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny dims on CPU/gloo; spawns --nproc ranks if not torchrun")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank (default 4 GPU, 2 CPU)")
    ap.add_argument("--seq", type=int, default=None, help="default 4096 GPU, 32 CPU")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank for the dispatch test (16384 GPU)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--impl", default="fast", choices=("fast", "reference"))
    ap.add_argument("--bf16-params", action="store_true", help="bf16 parameters, fp32 master in the optimizer")
    ap.add_argument("--compile", action="store_true", help="compile attention + norms (train.compile)")
    ap.add_argument("--strategies", nargs="+", default=["zero1", "epso"])
    ap.add_argument("--dispatchers", nargs="+", default=["allgather", "alltoall"])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    gpu_defaults = {"batch": 4, "seq": 4096, "tokens": 16384, "steps": 6, "warmup": 2}
    cpu_defaults = {"batch": 2, "seq": 32, "tokens": 256, "steps": 2, "warmup": 1}
    for key, value in (cpu_defaults if args.cpu else gpu_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.cpu and "RANK" not in os.environ:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args.nproc, port, args), nprocs=args.nproc, join=True)
        return
    main_rank(args)


if __name__ == "__main__":
    main(sys.argv[1:])
