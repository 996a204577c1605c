"""The trainer itself at the OLMoE-1B-7B shapes: `python -m moe_launch.trainer` on a real run directory and
real npy shards, its own per-step timing from metrics.jsonl (data loading, fault checks, host sync, logging included).

Run on one GPU:   PYTHONUNBUFFERED=1 python benchmarks/trainer_throughput.py --out $OUT
CPU smoke test:   python benchmarks/trainer_throughput.py --smoke

Each case writes random-token shards (vocab 50304; the values do not change the cost), a config.yaml with the
default trainer settings for a GPU (bf16 compute, train.param_dtype=auto -> bf16 parameters with the fp32 master in
the optimizer, model.moe.impl=auto -> FastSparseMoE kernels, chunked head + cross-entropy) plus `train.compile`, no
checkpoints, and runs the trainer as a subprocess. Reported: median tokens/s over the steps after warm-up (the
trainer's own `tokens_per_s`, measured around the whole step), MFU against the 989 TFLOP/s bf16 spec peak and, as in
benchmarks/train_step.py, against a dense bf16 GEMM rate measured after the trainer exits, and the final loss. The
-fp8 cases set model.moe.precision=fp8 (FP8 expert GEMMs; the same model FLOPs count), and are also given against
the peak of the step's precision mix ("MFU mix": the trainer's own mfu, trainer/tracking/flops.py step_peak).
"full attn": MFU against the bf16 spec with causal attention counted in full, as Megatron-LM and torchtitan count it
(flops_per_token(causal=False)): for comparing with figures quoted that way, never for our targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moe_launch.conf import presets
from moe_launch.conf.load import dump_config
from moe_launch.conf.schema import ClusterConfig, DataConfig, RootConfig, TrainConfig
from moe_launch.rundir import RunDir
from moe_launch.trainer.data import shards
from moe_launch.trainer.tracking.flops import flops_per_token, spec_peak, step_peak

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import dense_rate  # noqa: E402


def write_random_shards(out: Path, n_rows: int, seq_len: int, vocab: int, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rows_NL = np.random.default_rng(seed).integers(0, vocab, size=(n_rows, seq_len + 1), dtype=np.int64)
    rows_NL = rows_NL.astype(shards.token_dtype(vocab))
    shards.write_shard(out, 0, rows_NL)
    index = shards.ShardIndex(seq_len=seq_len, dtype=str(rows_NL.dtype), vocab_size=vocab, eos_id=0,
                              max_token_id=int(rows_NL.max()), shards=[{"file": shards.shard_name(0), "count": n_rows}],
                              tokenizer="random", seed=seed, shard_size=n_rows, total_tokens=int(rows_NL.size))
    shards.write_index(out, index)
    return out


def run_case(name: str, model, micro: int, accum: int, seq: int, steps: int, compile_: bool, work: Path,
             recompute: tuple[str, ...] = (), env_extra: dict | None = None) -> dict:
    data = write_random_shards(work / f"data-{name}", micro * accum * (steps + 1), seq, model.vocab_size)
    train = TrainConfig(steps=steps, global_batch_size=micro * accum, micro_batch_size=micro, seq_len=seq, lr=1e-4,
                        min_lr=1e-5, warmup_steps=2, ckpt_interval=0, log_interval=1, compile=compile_,
                        progress=False, recompute=list(recompute))
    cfg = RootConfig(model=model, train=train, data=DataConfig(path=str(data)), cluster=ClusterConfig(kind="local"))
    rd = RunDir(work / f"run-{name}").make()
    dump_config(cfg, rd.config)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533",
               **(env_extra or {}))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moe_launch.trainer", "--run-dir", str(rd.root)], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in rd.metrics.read_text().splitlines()] if rd.metrics.exists() else []
    out = {"case": name, "rc": proc.returncode, "wall_s": round(wall, 1), "steps_logged": len(records),
           "micro_batch": micro, "accum": accum, "seq": seq, "compile": compile_, "recompute": list(recompute),
           "env": env_extra or {}}
    if proc.returncode != 0 or len(records) < 3:
        out["stderr_tail"] = (proc.stdout + proc.stderr)[-3000:]
        return out
    warm = records[len(records) // 3:]  # the first steps include compilation and allocator warm-up
    out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in warm)
    # cross-check against the wall clock between logged records (each written after its step's host sync)
    gaps = [b["time"] - a["time"] for a, b in zip(warm, warm[1:])]
    out["tokens_per_s_wall"] = micro * accum * seq / statistics.median(gaps) if gaps else None
    out["final_loss"] = records[-1]["loss"]
    out["peak_gib"] = max((r.get("mem_gib") or 0.0) for r in records)
    out["flops_per_token"] = flops_per_token(model, seq)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run that checks the script")
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--only", default="", help="comma list of case names")
    args = ap.parse_args()
    base = presets.MODELS["olmoe_1b7b"]
    if args.smoke:
        tiny = dataclasses.replace(base, n_layers=2, d_model=64, n_heads=4, vocab_size=512, max_seq_len=64,
                                   moe=dataclasses.replace(base.moe, num_experts=8, top_k=2, expert_hidden=32))
        cases = [("smoke", tiny, 2, 1, 64, False, ()), ("smoke-recompute", tiny, 2, 1, 64, False, ("moe",)),
                 ("smoke-xs", tiny, 2, 1, 64, False, ())]
    else:
        fp8 = dataclasses.replace(base, moe=dataclasses.replace(base.moe, precision="fp8"))

        def unfused(m):  # model.moe.grad_accumulation_fusion=false
            return dataclasses.replace(m, moe=dataclasses.replace(m.moe, grad_accumulation_fusion=False))

        def router_fp32(m):  # model.moe.router_gemm=fp32
            return dataclasses.replace(m, moe=dataclasses.replace(m.moe, router_gemm="fp32"))

        def xent_torch(m):  # model.cross_entropy_fusion=false
            return dataclasses.replace(m, cross_entropy_fusion=False)

        def qk(m, fused):  # model.qk_norm_rope_fusion: QK-norm and RoPE as one kernel, or as the compiled modules
            return dataclasses.replace(m, qk_norm_rope_fusion=fused)

        def cutlass(m):  # model.moe.grouped_gemm=torch: every row GEMM on torch's CUTLASS kernels
            return dataclasses.replace(m, moe=dataclasses.replace(m.moe, grouped_gemm="torch"))

        def graphed(m, mode="true"):  # model.moe.cuda_graph=true (every call) | false (never); the default is auto
            return dataclasses.replace(m, moe=dataclasses.replace(m.moe, cuda_graph=mode))

        l4, l4_fp8 = dataclasses.replace(base, n_layers=4), dataclasses.replace(fp8, n_layers=4)
        cases = [("olmoe-4L", l4, 4, 1, 4096, True, ()),
                 ("olmoe-4L-fp8", l4_fp8, 4, 1, 4096, True, ()),
                 ("olmoe-16L", base, 2, 1, 4096, True, ()),
                 ("olmoe-16L-fp8", fp8, 2, 1, 4096, True, ()),
                 # memory: the MoE layers' saved activations are the largest share at 16 layers
                 ("olmoe-16L-rc-moe", base, 2, 1, 4096, True, ("moe",)),
                 ("olmoe-16L-4x-rc-moe", base, 4, 1, 4096, True, ("moe",)),
                 ("olmoe-16L-4x-rc-full", base, 4, 1, 4096, True, ("full",)),
                 # two micro-batches per step, and recomputed experts: FP8 quantizes each weight once per step there
                 # (model.moe.fp8_weight_reuse), against bf16 on the same batches
                 ("olmoe-16L-2mb", base, 2, 2, 4096, True, ()),
                 ("olmoe-16L-fp8-2mb", fp8, 2, 2, 4096, True, ()),
                 ("olmoe-16L-fp8-rc-moe", fp8, 2, 1, 4096, True, ("moe",)),
                 # four micro-batches per step: the optimizer update and FP8's weight quantization amortized
                 ("olmoe-16L-4mb", base, 2, 4, 4096, True, ()),
                 ("olmoe-16L-fp8-4mb", fp8, 2, 4, 4096, True, ()),
                 # the same with every row GEMM on CUTLASS: at 8k tokens per call, auto takes our TMA kernel
                 ("olmoe-16L-4mb-cutlass", cutlass(base), 2, 4, 4096, True, ()),
                 ("olmoe-16L-fp8-4mb-cutlass", cutlass(fp8), 2, 4, 4096, True, ()),
                 # toward the many micro-batches per GPU-step of a real global batch: what is left per micro-batch
                 ("olmoe-16L-8mb", base, 2, 8, 4096, True, ()),
                 ("olmoe-16L-fp8-8mb", fp8, 2, 8, 4096, True, ()),
                 ("olmoe-4L-4mb", l4, 4, 4, 4096, True, ()),
                 ("olmoe-4L-fp8-4mb", l4_fp8, 4, 4, 4096, True, ()),
                 ("olmoe-4L-fp8-8x-4mb", l4_fp8, 8, 4, 4096, True, ()),
                 ("olmoe-4L-fp8-16x-4mb", l4_fp8, 16, 4, 4096, True, ()),
                 # the expert weight gradients returned to autograd, which adds them to the gradient buffers
                 ("olmoe-16L-8mb-unfused", unfused(base), 2, 8, 4096, True, ()),
                 ("olmoe-16L-fp8-8mb-unfused", unfused(fp8), 2, 8, 4096, True, ()),
                 ("olmoe-4L-fp8-4mb-unfused", unfused(l4_fp8), 4, 4, 4096, True, ()),
                 # the same tokens per step as 8 micro-batches of 2x4096, in 4 of 4x4096: larger GEMMs, more memory
                 ("olmoe-16L-4x-4mb", base, 4, 4, 4096, True, ()),
                 ("olmoe-16L-fp8-4x-4mb", fp8, 4, 4, 4096, True, ()),
                 ("olmoe-16L-fp8-4x-4mb-xs", fp8, 4, 4, 4096, True, ()),
                 # twice the micro-batches per step (still far below a real global batch's): the optimizer update and
                 # the FP8 weight quantization, once per step, weigh half as much
                 ("olmoe-16L-4x-8mb", base, 4, 8, 4096, True, ()),
                 ("olmoe-16L-fp8-4x-8mb", fp8, 4, 8, 4096, True, ()),
                 ("olmoe-16L-fp8-4x-16mb", fp8, 4, 16, 4096, True, ()),
                 # QK-norm and RoPE as one kernel each for q and k, and as the compiled modules
                 ("olmoe-4L-fp8-16x-4mb-qk-fused", qk(l4_fp8, True), 16, 4, 4096, True, ()),
                 ("olmoe-4L-fp8-16x-4mb-qk-modules", qk(l4_fp8, False), 16, 4, 4096, True, ()),
                 # the router's GEMMs in fp32 on the CUDA cores
                 ("olmoe-16L-fp8-8mb-router-fp32", router_fp32(fp8), 2, 8, 4096, True, ()),
                 ("olmoe-4L-fp8-4mb-router-fp32", router_fp32(l4_fp8), 4, 4, 4096, True, ()),
                 # the head's softmax and loss gradient in torch's passes instead of the fused kernel
                 ("olmoe-4L-fp8-4mb-xent-torch", xent_torch(l4_fp8), 4, 4, 4096, True, ()),
                 ("olmoe-4L-fp8-16x-4mb-xent-torch", xent_torch(l4_fp8), 16, 4, 4096, True, ()),
                 ("olmoe-16L-fp8-4x-4mb-xent-torch", xent_torch(fp8), 4, 4, 4096, True, ()),
                 ("olmoe-4L-4mb-xent-torch", xent_torch(l4), 4, 4, 4096, True, ()),
                 # few tokens per layer call (1k, 2k), where queueing the experts' kernels takes longer than running
                 # them: eager, the default (auto: graphs for calls that small), and graphs for every call
                 ("olmoe-16L-1k-8mb-eager", graphed(base, "false"), 1, 8, 1024, True, ()),
                 ("olmoe-16L-1k-8mb", base, 1, 8, 1024, True, ()),
                 ("olmoe-16L-2k-8mb-eager", graphed(base, "false"), 1, 8, 2048, True, ()),
                 ("olmoe-16L-2k-8mb", base, 1, 8, 2048, True, ()),
                 ("olmoe-16L-4k-8mb-eager", graphed(base, "false"), 1, 8, 4096, True, ()),
                 ("olmoe-16L-4k-8mb", base, 1, 8, 4096, True, ()),
                 ("olmoe-16L-4k-8mb-graph", graphed(base), 1, 8, 4096, True, ()),
                 # the same with the caching allocator's expandable segments (less fragmentation near the limit)
                 ("olmoe-16L-xs", base, 2, 1, 4096, True, ()),
                 ("olmoe-16L-fp8-xs", fp8, 2, 1, 4096, True, ()),
                 ("olmoe-16L-rc-moe-xs", base, 2, 1, 4096, True, ("moe",))]
    only = set(filter(None, args.only.split(",")))
    rows, models = [], {}
    with tempfile.TemporaryDirectory(prefix="moe-trainer-bench-") as tmp:
        for name, model, micro, accum, seq, compile_, recompute in cases:
            if only and name not in only:
                continue
            env_extra = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if name.endswith("-xs") else None
            r = run_case(name, model, micro, accum, seq, 4 if args.smoke else args.steps, compile_, Path(tmp),
                         recompute, env_extra)
            models[name] = model
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "stderr_tail"}), flush=True)
            if "stderr_tail" in r:
                print(r["stderr_tail"], flush=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rate = dense_rate(device, 256 if args.smoke else 8192)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    spec = spec_peak(gpu)
    for r in rows:
        if "tokens_per_s" in r:
            used = r["flops_per_token"] * r["tokens_per_s"]
            r["mfu"] = used / rate
            r["mfu_spec"] = used / spec if spec else None  # the bf16 peak, FP8 experts too: comparable across rows
            mix = step_peak(models[r["case"]], r["seq"], gpu)  # FP8 experts: the peak of the step's precision mix
            r["mfu_spec_mix"] = used / mix if mix else None
            # as Megatron-LM and torchtitan count (causal attention not halved): for comparing with their figures
            full = flops_per_token(models[r["case"]], r["seq"], causal=False) * r["tokens_per_s"]
            r["mfu_spec_full_attention"] = full / spec if spec else None
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dense_tflops": rate / 1e12}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "trainer_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\n{meta}\n{'case':21s} {'rc':>3s} {'tok/s':>9s} {'wall tok/s':>10s} {'MFU spec':>8s} "
          f"{'MFU mix':>8s} {'full attn':>9s} {'MFU dense':>9s} {'peak GiB':>8s} {'loss':>7s}")
    for r in rows:
        if "tokens_per_s" in r:
            spec_cols = " ".join(f"{100 * r[k]:7.1f}%" if r[k] else f"{'-':>8s}" for k in ("mfu_spec", "mfu_spec_mix"))
            full = r["mfu_spec_full_attention"]
            spec_cols += f" {100 * full:8.1f}%" if full else f" {'-':>9s}"
            print(f"{r['case']:21s} {r['rc']:3d} {r['tokens_per_s']:9.0f} {r['tokens_per_s_wall'] or 0:10.0f} "
                  f"{spec_cols} {100 * r['mfu']:8.1f}% {r['peak_gib']:8.1f} {r['final_loss']:7.3f}")
        else:
            print(f"{r['case']:21s} {r['rc']:3d} FAILED (see above)")


if __name__ == "__main__":
    main()
