"""Training-health measurements on one GPU: determinism, aux-loss-free balancing, and the skew guard's memory.

One GPU:    PYTHONUNBUFFERED=1 python benchmarks/stability.py --out $OUT            (~2.5 min on an H200)
CPU smoke:  python benchmarks/stability.py --smoke --out /tmp/stab                 (tiny, checks the script)

Parts (each writes its JSON under --out as soon as it ends, so a timeout keeps what was measured):
  determinism   the real Trainer with train.deterministic=true, 50 steps, twice from scratch and once interrupted (an
                injected crash at step 27) and resumed from the step-25 checkpoint; bitwise comparison of every
                parameter and optimizer-state tensor after step 50. Once per expert path (model.moe.impl=auto, i.e.
                the FastSparseMoE kernels on CUDA, and impl=reference) with the wall time of each, so the cost of
                falling back to the reference is on record.
  balance       200-step loss curves of the real Trainer for model.moe.balance = aux_loss, aux_free_bias, sinkhorn
                on the same data order and init: lm loss, and the max/mean expert load of the step.
  skew          one MoE layer at the OLMoE shapes (16k tokens, d 2048, 64 experts, top-8, F 1024, bf16, kernels):
                peak memory of forward+backward with balanced routing, with every token routed to the same 8
                experts, and with that skew under the guard at a quarter of the rows; against the estimate of
                trainer/moe/skew.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts (deterministic cuBLAS)

import torch  # noqa: E402

from moe_launch.conf.schema import (  # noqa: E402
    ClusterConfig,
    DataConfig,
    FaultInjection,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RootConfig,
    TrainConfig,
)
from moe_launch.rundir import EXIT_OK, RunDir, read_jsonl  # noqa: E402


def model_config(smoke: bool, impl: str, balance: str) -> ModelConfig:
    if smoke:
        return ModelConfig(name="stab_smoke", kind="moe", vocab_size=512, d_model=32, n_layers=2, n_heads=4,
                           max_seq_len=32, moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, impl=impl,
                                                         balance=balance))
    return ModelConfig(name="stab", kind="moe", vocab_size=4096, d_model=512, n_layers=4, n_heads=8, max_seq_len=1024,
                       moe=MoEConfig(num_experts=64, top_k=8, expert_hidden=256, impl=impl, balance=balance))


def root_config(smoke: bool, data_cache: str, impl: str = "auto", balance: str = "aux_loss", **train) -> RootConfig:
    t = dict(global_batch_size=4, micro_batch_size=4, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=2,
             dtype="fp32") if smoke else dict(global_batch_size=16, micro_batch_size=16, seq_len=1024, lr=1e-3,
                                              min_lr=1e-4, warmup_steps=20, dtype="bf16")
    t.update(dict(schedule="cosine", progress=False, seed=1234, compile=False), **train)
    return RootConfig(model=model_config(smoke, impl, balance), parallel=ParallelConfig(dp=1),
                      train=TrainConfig(**t), data=DataConfig(cache_dir=data_cache, workers=1 if smoke else 8),
                      cluster=ClusterConfig(kind="local", nodes=1, tasks_per_node=1))


def _trainer(cfg: RootConfig, run_dir: Path, device: torch.device, attempt: int = 0):
    from moe_launch.trainer.loop import Trainer

    return Trainer(cfg, RunDir(run_dir), attempt=attempt, device=device)


def _state(trainer) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    for b, s in trainer.optimizer.state_dict()["buckets"].items():
        for k, v in s.items():
            if torch.is_tensor(v):
                out[f"optim/{b}/{k}"] = v.detach().cpu().clone()
    return out


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if k not in b or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def determinism(args, device: torch.device, out: Path) -> dict:
    from moe_launch.trainer.faults import InjectedCrash

    steps = 6 if args.smoke else 50
    ckpt = steps // 2
    res = {}
    for impl in ("auto", "reference"):
        common = dict(steps=steps, deterministic=True, ckpt_interval=ckpt)
        if not args.smoke:
            common["global_batch_size"] = common["micro_batch_size"] = 8
        states, seconds = [], []
        for i in range(2):
            t0 = time.perf_counter()
            tr = _trainer(root_config(args.smoke, args.data_cache, impl, **common), out / f"det-{impl}-{i}", device)
            assert tr.train() == EXIT_OK
            seconds.append(round(time.perf_counter() - t0, 1))
            states.append(_state(tr))
            del tr
        crash = root_config(args.smoke, args.data_cache, impl, **common,
                            fault_injection=FaultInjection(kind="crash", rank=0, step=ckpt + 2, attempt=0))
        rd = out / f"det-{impl}-resumed"
        try:
            _trainer(crash, rd, device).train()
        except InjectedCrash:
            pass
        time.sleep(3)  # a background checkpoint write of the crashed attempt finishes
        tr = _trainer(crash, rd, device, attempt=1)
        start = tr.start_step
        assert tr.train() == EXIT_OK
        resumed = _state(tr)
        del tr
        loss = [[r["loss"] for r in read_jsonl(RunDir(out / f"det-{impl}-{i}").metrics)] for i in range(2)]
        res[impl] = {"seconds_per_run": seconds, "tensors": len(states[0]),
                     "run2_differs_in": _diff(states[0], states[1])[:8],
                     "resumed_from_step": start, "resumed_differs_in": _diff(states[0], resumed)[:8],
                     "losses_equal": loss[0] == loss[1], "final_loss": loss[0][-1]}
        res[impl]["bitwise"] = not res[impl]["run2_differs_in"] and not res[impl]["resumed_differs_in"]
        print(f"[determinism] impl={impl:9s} bitwise={res[impl]['bitwise']} (two runs: "
              f"{not res[impl]['run2_differs_in']}, resumed at {start}: {not res[impl]['resumed_differs_in']}) "
              f"{seconds} s per {steps}-step run", flush=True)
        _release(device)
    return res


def balance_curves(args, device: torch.device, out: Path) -> dict:
    steps = 8 if args.smoke else 200
    res = {}
    for balance in ("aux_loss", "aux_free_bias", "sinkhorn"):
        cfg = root_config(args.smoke, args.data_cache, "auto", balance, steps=steps, ckpt_interval=0)
        t0 = time.perf_counter()
        tr = _trainer(cfg, out / f"balance-{balance}", device)
        assert tr.train() == EXIT_OK
        del tr
        recs = sorted(read_jsonl(RunDir(out / f"balance-{balance}").metrics), key=lambda r: r["step"])
        lm = [r["lm_loss"] for r in recs]
        load = [r["expert_load_max"] for r in recs]
        last = max(1, len(recs) // 4)
        res[balance] = {"seconds": round(time.perf_counter() - t0, 1), "lm_loss": lm, "load_max": load,
                        "final_lm_mean_last_quarter": sum(lm[-last:]) / last,
                        "load_max_mean_last_quarter": sum(load[-last:]) / last}
        print(f"[balance] {balance:13s} lm {lm[0]:.3f} -> {lm[-1]:.3f} (last-quarter mean "
              f"{res[balance]['final_lm_mean_last_quarter']:.4f}), max/mean load last quarter "
              f"{res[balance]['load_max_mean_last_quarter']:.2f}, {res[balance]['seconds']} s", flush=True)
        _release(device)
    return res


def skew_memory(args, device: torch.device) -> dict:
    from moe_launch.trainer.moe.layer import MoELayer
    from moe_launch.trainer.moe.skew import ChunkedExperts, balanced_rows, expert_bytes_per_row, worst_case_rows

    T, D, F, E, K = (256, 32, 48, 8, 2) if args.smoke else (16384, 2048, 1024, 64, 8)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    res = {"shape": dict(T=T, D=D, F=F, E=E, K=K, dtype=str(dtype)),
           "estimate_rows": worst_case_rows(T, K, 1, "allgather"),
           "estimate_bytes": worst_case_rows(T, K, 1, "allgather") * expert_bytes_per_row(D, F, dtype.itemsize, 1),
           "balanced_rows": balanced_rows(T, K, 1, "allgather")}
    for case in ("balanced", "skewed", "skewed_guarded"):
        torch.manual_seed(0)
        cfg = MoEConfig(num_experts=E, top_k=K, expert_hidden=F, impl="fast" if not args.smoke else "reference",
                        uniform_routing=case == "balanced")
        layer = MoELayer(D, cfg).to(device)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        with torch.no_grad():
            if case != "balanced":  # every token to experts 0..K-1 (input column 0 is 1)
                layer.router.weight.zero_()
                layer.router.weight[:K, 0] = torch.arange(K, 0, -1, dtype=torch.float32, device=device) * 5
        layer = layer.to(dtype)
        if case == "skewed_guarded":
            layer.experts_fn = ChunkedExperts(layer.experts_fn, res["estimate_rows"] // 4)
        x = torch.randn(1, T, D, device=device, dtype=dtype)
        x[..., 0] = 1
        x.requires_grad_()
        _release(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        y, stats = layer(x)
        y.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
        counts = stats.counts_E.tolist()
        res[case] = {"peak_bytes_over_inputs": peak, "seconds": round(time.perf_counter() - t0, 3),
                     "max_over_mean_load": max(counts) / (sum(counts) / len(counts)),
                     "chunked": getattr(layer.experts_fn, "events", None)}
        print(f"[skew] {case:15s} peak {peak / 2**30:6.2f} GiB over inputs, max/mean load "
              f"{res[case]['max_over_mean_load']:.1f}", flush=True)
        del layer, x, y, stats
    print(f"[skew] estimate: {res['estimate_rows']} rows, {res['estimate_bytes'] / 2**30:.2f} GiB", flush=True)
    return res


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/stability")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--data-cache", default="~/.cache/moe-launch/data")
    ap.add_argument("--only", default="determinism,balance,skew")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no GPU (use --smoke on CPU)")
    device = torch.device("cuda", torch.cuda.current_device()) if not args.smoke else torch.device("cpu")
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "smoke": args.smoke,
            "model": dataclasses.asdict(model_config(args.smoke, "auto", "aux_loss"))}
    parts = {"determinism": lambda: determinism(args, device, out),
             "balance": lambda: balance_curves(args, device, out), "skew": lambda: skew_memory(args, device)}
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            result = parts[name]()
        except Exception as e:  # one failing part must not cost the others
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        result["part_seconds"] = round(time.perf_counter() - t0, 1)
        (out / f"stability_{name}.json").write_text(json.dumps({"meta": meta, name: result}, indent=1))
        _release(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
