"""Loss-curve benchmark: does the fast training path learn like the reference MoE path?

On one GPU:   PYTHONUNBUFFERED=1 python benchmarks/loss_curve.py --out $OUT          (~1 min per run on an H200)
CPU smoke:    python benchmarks/loss_curve.py --smoke --out /tmp/lc                  (tiny model, 5 steps)
FP8 vs bf16:  python benchmarks/loss_curve.py --compare precision --out $OUT      (3 runs of 500 steps)
Router GEMMs: python benchmarks/loss_curve.py --compare router --out $OUT         (fp32 vs the default bf16)
Data only:    python benchmarks/loss_curve.py --prepare-only --data-cache DIR        (tokenize the corpus, no training)

Runs the real Trainer (moe_launch.trainer.loop.Trainer) three times on the same data order and the same init
(train.seed), each in a fresh run directory under --out:
  fast       model.moe.impl=fast (Triton kernels), train.dtype=bf16 (bf16 params, fp32 masters in the optimizer)
  ref_bf16   model.moe.impl=reference, train.dtype=bf16
  ref_fp32   model.moe.impl=reference, train.dtype=fp32: the yardstick of what bf16 rounding alone changes
and compares the per-step lm loss. The verdict: "fast vs reference within bf16 noise: yes" when, over the last
--window steps, mean |fast - ref_bf16| <= 2 * mean |ref_bf16 - ref_fp32| + 0.01 (in nats). With --compile the fast
run also sets train.compile (the dense parts compiled: trainer/compile.py).
Smoke mode runs all three in fp32 on CPU (bf16 is not what CPU runs) and reports the numbers without a verdict.

Model: a small OLMoE-like MoE (d 512, 4 layers, 8 heads, 64 experts, top-8, expert FFN 256, vocab 4096), sequence
1024, global batch 16, AdamW 1e-3 with 20 warm-up steps then cosine to 1e-4, on the built-in corpus (2.3M tokens at
vocab 4096 = 2,271 sequences, tokenized into --data-cache before the first run; 200 steps read 1.4 epochs of it, in
the same order for all three runs). 109M parameters, ~19M active per token. Output: loss_curve.json in --out (the
three curves, per-run wall time and median tokens/s, the summary), written after every run, and a printed summary.

`--compare precision` runs bf16, bf16 from another init seed and FP8 experts instead (all impl=fast, same data order,
500 steps by default = 3.7 epochs of the corpus, each epoch in its own order), with --holdout sequences of the corpus
set aside and each trained model's loss on them reported; benchmarks/loss_curve_precision.py says how the noise
yardstick is built and what the verdict's rule is. `--compare router` is the same with model.moe.router_gemm=fp32 in
the FP8 run's place (JSON: loss_curve_router.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import time
import traceback
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from moe_launch.conf.schema import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RootConfig,
    TrainConfig,
)
from moe_launch.rundir import EXIT_OK, RunDir, read_jsonl

RUNS = (  # name, model.moe.impl, train.dtype (smoke mode: fp32 for all)
    ("fast", "fast", "bf16"),
    ("ref_bf16", "reference", "bf16"),
    ("ref_fp32", "reference", "fp32"),
)
NOISE_FACTOR, NOISE_FLOOR = 2.0, 0.01  # the verdict's threshold: 2 * bf16 noise + 0.01 nats


def model_config(smoke: bool, impl: str, precision: str = "bf16", router_gemm: str = "bf16") -> ModelConfig:
    if smoke:
        return ModelConfig(name="loss_curve_smoke", kind="moe", vocab_size=512, d_model=32, n_layers=2, n_heads=4,
                           max_seq_len=32, moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, impl=impl,
                                                         precision=precision, router_gemm=router_gemm))
    return ModelConfig(name="loss_curve", kind="moe", vocab_size=4096, d_model=512, n_layers=4, n_heads=8,
                       max_seq_len=1024, moe=MoEConfig(num_experts=64, top_k=8, expert_hidden=256, impl=impl,
                                                       precision=precision, router_gemm=router_gemm))


def train_config(smoke: bool, steps: int, dtype: str, compile_: bool) -> TrainConfig:
    if smoke:
        return TrainConfig(steps=steps, global_batch_size=4, micro_batch_size=4, seq_len=32, lr=3e-3, min_lr=3e-4,
                           warmup_steps=2, dtype="fp32", ckpt_interval=0, progress=False, seed=1234)
    return TrainConfig(steps=steps, global_batch_size=16, micro_batch_size=16, seq_len=1024, lr=1e-3, min_lr=1e-4,
                       warmup_steps=min(20, steps // 5), schedule="cosine", dtype=dtype, ckpt_interval=0,
                       progress=False, seed=1234, compile=compile_)


def root_config(smoke: bool, steps: int, impl: str, dtype: str, compile_: bool, data_cache: str,
                precision: str = "bf16", router_gemm: str = "bf16") -> RootConfig:
    # workers: tokenization processes of the one-time data build
    return RootConfig(model=model_config(smoke, impl, precision, router_gemm), parallel=ParallelConfig(dp=1),
                      train=train_config(smoke, steps, dtype, compile_),
                      data=DataConfig(cache_dir=data_cache, workers=1 if smoke else 4),
                      cluster=ClusterConfig(kind="local", nodes=1, tasks_per_node=1))


def split_heldout(dataset: Path, out: Path, heldout: int) -> tuple[Path, Path]:
    """Set the prepared dataset's last `heldout` sequences aside (the built-in corpus is shuffled when it is prepared,
    so they are a random sample): out/train-data holds the others, out/heldout-data those, both prepared datasets
    (the trainer's data.path and data.eval_path). The prepared dataset itself is left as it is."""
    from moe_launch.trainer.data import shards

    index = shards.read_index(dataset)
    rows_NL = np.concatenate([np.asarray(s) for s in shards.open_shards(dataset, index)])
    if not 0 < heldout < len(rows_NL):
        raise SystemExit(f"--holdout {heldout}: the dataset has {len(rows_NL)} sequences; hold out fewer")
    dirs = []
    for name, part_NL in (("train-data", rows_NL[:-heldout]), ("heldout-data", rows_NL[-heldout:])):
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        shards.write_shard(d, 0, part_NL)
        shards.write_index(d, dataclasses.replace(
            index, shards=[{"file": shards.shard_name(0), "count": len(part_NL)}], shard_size=len(part_NL),
            total_tokens=int(part_NL.size)))
        dirs.append(d)
    return dirs[0], dirs[1]


def with_heldout(cfg: RootConfig, train_dir: Path, heldout_dir: Path, sequences: int, every: int) -> RootConfig:
    """The run trained on train_dir and evaluated on all of heldout_dir every `every` steps and after the last
    (the trainer's own held-out evaluation, trainer/evaluate.py)."""
    batches, left = divmod(sequences, cfg.train.global_batch_size)
    if left or not batches:
        raise SystemExit(f"--holdout {sequences}: use a multiple of the global batch ({cfg.train.global_batch_size})")
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, path=str(train_dir), eval_path=str(heldout_dir), format="npy"),
        train=dataclasses.replace(cfg.train, eval_interval=every, eval_batches=batches))


def run_trainer(cfg: RootConfig, run_dir: Path, device: torch.device,
                init_seed: Optional[int] = None) -> tuple[list[float], dict]:
    """One Trainer run from scratch in `run_dir`: the per-step lm loss, and the run's wall seconds and median
    tokens/s (steps past the first 5: compilation and warm-up excluded). `init_seed` other than train.seed: the
    initial weights are those the Trainer would build under that seed, the data order still follows train.seed.
    With train.eval_interval set, the held-out losses the trainer recorded go into the stats ("heldout": [step,
    loss] pairs; "heldout_lm_loss": the last one, the final model's)."""
    from moe_launch.trainer.loop import Trainer  # imported here: --prepare-only and --help need no trainer import
    from moe_launch.trainer.standby import warm_model

    t0 = time.perf_counter()
    model = None
    if init_seed is not None and init_seed != cfg.train.seed:
        model = warm_model(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=init_seed)), device)
    trainer = Trainer(cfg, RunDir(run_dir), device=device, model=model)
    del model
    if device.type == "cuda" and cfg.train.dtype == "fp32":
        # the Trainer turns TF32 matmuls on for non-deterministic runs; the yardstick must be true fp32 (TF32 rounds
        # the matmul inputs to 10-bit mantissas, which would inflate the "noise" the verdict is measured against)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    code = trainer.train()
    del trainer
    seconds = time.perf_counter() - t0
    if code != EXIT_OK:
        raise RuntimeError(f"trainer exited with code {code}; see {run_dir}/metrics.jsonl and faults/")
    records = sorted(read_jsonl(RunDir(run_dir).metrics), key=lambda r: r["step"])
    rates = sorted(float(r["tokens_per_s"]) for r in records[5:] if "tokens_per_s" in r)
    stats = {"seconds": round(seconds, 1), "median_tokens_per_s": rates[len(rates) // 2] if rates else None}
    evals = read_jsonl(RunDir(run_dir).evals) if RunDir(run_dir).evals.exists() else []
    if evals:
        stats["heldout"] = [[e["step"], e["eval_lm_loss"]] for e in evals]
        stats["heldout_lm_loss"] = evals[-1]["eval_lm_loss"]
    return [float(r["lm_loss"]) for r in records], stats


def _mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / max(1, min(len(a), len(b)))


def _max_abs(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def summarize(curves: dict[str, list[float]], window: int, verdict: bool) -> dict:
    """Pure: the comparison of the three curves over their last `window` steps (and max |diff| over all steps)."""
    fast, ref, ref32 = curves["fast"], curves["ref_bf16"], curves["ref_fp32"]
    n = min(len(fast), len(ref), len(ref32))
    w = min(window, n)
    fast_vs_ref = _mean_abs(fast[n - w:n], ref[n - w:n])
    noise = _mean_abs(ref[n - w:n], ref32[n - w:n])
    threshold = NOISE_FACTOR * noise + NOISE_FLOOR
    out = {
        "steps": n, "window": w,
        "mean_abs_fast_vs_ref_bf16": fast_vs_ref,
        "mean_abs_ref_bf16_vs_ref_fp32": noise,
        "max_abs_fast_vs_ref_bf16": _max_abs(fast[:n], ref[:n]),
        "max_abs_ref_bf16_vs_ref_fp32": _max_abs(ref[:n], ref32[:n]),
        "final": {name: c[n - 1] for name, c in curves.items()},
        "first": {name: c[0] for name, c in curves.items()},
        "threshold": threshold,
    }
    if verdict:
        out["within_bf16_noise"] = fast_vs_ref <= threshold
        out["verdict"] = f"fast vs reference within bf16 noise: {'yes' if out['within_bf16_noise'] else 'no'}"
    else:
        out["verdict"] = "smoke run (fp32 on CPU for all three): no verdict"
    return out


def prepare_data(data_cache: str, smoke: bool) -> Path:
    from moe_launch.trainer.data import resolve_dataset

    cfg = root_config(smoke, 1, "reference", "fp32", False, data_cache)
    return resolve_dataset(cfg.data, cfg.train.seq_len, cfg.model.vocab_size)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None,
                    help="optimizer steps per run (default 200, --compare precision 500; smoke 5, precision 8)")
    ap.add_argument("--out", default="runs/loss_curve", help="directory for the JSON and the run dirs")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run in fp32 that checks the script")
    ap.add_argument("--compare", choices=("impl", "precision", "router"), default="impl",
                    help="impl: fast vs reference vs fp32 (loss_curve.json); precision: bf16 vs bf16 from another "
                         "init seed vs FP8 experts (loss_curve_precision.json); router: the same with the router's "
                         "GEMMs in fp32 as the variant (loss_curve_router.json)")
    ap.add_argument("--window", type=int, default=100, help="compare the mean |diff| over the last N steps")
    ap.add_argument("--smooth", type=int, default=20, help="--compare precision: trailing mean of N steps for the "
                                                           "smoothed figures")
    ap.add_argument("--compile", action="store_true",
                    help="train.compile=true for the fast run (--compare precision: for all three runs)")
    ap.add_argument("--data-cache", default="~/.cache/moe-launch/data", help="data.cache_dir (built-in corpus)")
    ap.add_argument("--prepare-only", action="store_true", help="tokenize the built-in corpus and exit")
    ap.add_argument("--holdout", type=int, default=None,
                    help="--compare precision: sequences of the corpus set aside, never trained on, each run's loss "
                         "on them measured by the trainer (default 128; smoke 8; 0: none)")
    ap.add_argument("--seed", type=int, default=None,
                    help="--compare precision: train.seed A of all three runs (the data order; bf16 and fp8 init "
                         "from A, bf16_b from A + 1; default 1234); another A repeats the comparison on another order")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="--compare precision: steps between held-out evaluations (default 50; smoke 4)")
    args = ap.parse_args(argv)
    import loss_curve_precision as precision_mode  # beside this script (its folder is on sys.path)

    by_precision = args.compare in precision_mode.VARIANTS  # a variant of the bf16 recipe against its noise
    variant = precision_mode.VARIANTS.get(args.compare, "")
    steps = args.steps or ((8 if by_precision else 5) if args.smoke else (500 if by_precision else 200))
    if args.prepare_only:
        print(f"dataset: {prepare_data(args.data_cache, args.smoke)}", flush=True)
        return 0
    if torch.cuda.is_available() and not args.smoke:
        device = torch.device("cuda", torch.cuda.current_device())  # an explicit index, as the trainer's own
    elif args.smoke:
        device = torch.device("cpu")
    else:
        raise SystemExit("no GPU: the bf16 comparison needs one (use --smoke on CPU)")
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())

    t0 = time.perf_counter()
    dataset = prepare_data(args.data_cache, args.smoke)
    print(f"[loss_curve] dataset {dataset} ({time.perf_counter() - t0:.1f} s)", flush=True)
    holdout = 0
    if by_precision:
        seed_a = precision_mode.SEED_A if args.seed is None else args.seed
        settings = {"bf16": {}, "fp8": {"precision": "fp8"}, "router_fp32": {"router_gemm": "fp32"}}
        runs = precision_mode.plan(args.smoke, lambda setting: root_config(
            args.smoke, steps, "fast", "bf16", args.compile, args.data_cache, **settings[setting]), seed_a, variant)
        holdout = args.holdout if args.holdout is not None else (8 if args.smoke else 128)
        if holdout:
            every = args.eval_every or (4 if args.smoke else 50)
            dataset, heldout_dir = split_heldout(dataset, out / f"data-{stamp}", holdout)
            runs = [r._replace(cfg=with_heldout(r.cfg, dataset, heldout_dir, holdout, every)) for r in runs]
    else:
        runs = [precision_mode.PrecisionRun(name, root_config(
            args.smoke, steps, impl, "fp32" if args.smoke else dtype, args.compile and name == "fast",
            args.data_cache), None, "") for name, impl, dtype in RUNS]
    curves: dict[str, list[float]] = {}
    stats: dict[str, dict] = {}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "steps": steps, "smoke": args.smoke, "compile_fast": args.compile,
            "model": dataclasses.asdict(model_config(args.smoke, "fast")), "train": dataclasses.asdict(
                train_config(args.smoke, steps, "bf16", args.compile)),
            "runs": stats}
    if by_precision:
        meta.update(compare=args.compare, epochs=_epochs(dataset, steps * runs[0].cfg.train.global_batch_size),
                    data_seed=runs[0].cfg.train.seed, rule=precision_mode.rule(variant),
                    heldout_sequences=holdout,
                    plan={r.name: {"precision": r.cfg.model.moe.precision, "setting": r.label,
                                   "router_gemm": r.cfg.model.moe.router_gemm, "init_seed": r.init_seed,
                                   "impl": r.cfg.model.moe.impl, "dtype": r.cfg.train.dtype} for r in runs})
    json_name = f"loss_curve_{args.compare}.json" if by_precision else "loss_curve.json"
    summary: dict = {}
    for name, cfg, init_seed, label in runs:
        try:
            curves[name], stats[name] = run_trainer(cfg, out / f"run-{stamp}-{name}", device, init_seed)
            extra = f" {label} init_seed={init_seed}" if by_precision else ""
            if "heldout_lm_loss" in stats[name]:
                extra += f" held-out loss {stats[name]['heldout_lm_loss']:.4f}"
            print(f"[loss_curve] {name:9s} impl={cfg.model.moe.impl:9s} dtype={cfg.train.dtype:4s} "
                  f"compile={cfg.train.compile!s:5s}{extra} {stats[name]['seconds']:7.1f} s  "
                  f"{stats[name]['median_tokens_per_s'] or 0:9.0f} tok/s  "
                  f"loss {curves[name][0]:.4f} -> {curves[name][-1]:.4f}", flush=True)
        except Exception as e:  # one failing run must not cost the others' curves
            traceback.print_exc()
            stats[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if len(curves) == len(runs):
            if by_precision:
                rates = {n: stats[n]["median_tokens_per_s"] for n in curves}
                heldout = {n: stats[n]["heldout_lm_loss"] for n in curves if "heldout_lm_loss" in stats[n]}
                summary = precision_mode.summarize(curves, rates, args.window, args.smooth, verdict=not args.smoke,
                                                   heldout=heldout or None, variant=variant)
            else:
                summary = summarize(curves, args.window, verdict=not args.smoke)
        _write(out / json_name, meta, summary, curves)  # after every run: a timeout keeps what was measured
    if not summary:
        print("[loss_curve] not all three runs finished: no summary (see the errors above)", flush=True)
        return 1
    print(json.dumps(summary, indent=2), flush=True)
    print(precision_mode.table(summary) if by_precision else summary["verdict"], flush=True)
    return 0


def _epochs(dataset: Path, sequences: int) -> Optional[float]:
    """How many passes over the prepared dataset `sequences` training sequences make (None: no index to read)."""
    try:
        return round(sequences / json.loads((dataset / "index.json").read_text())["total_instances"], 2)
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


def _write(path: Path, meta: dict, summary: dict, curves: dict[str, list[float]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "summary": summary, "curves": curves}, indent=2, default=str))
    os.replace(tmp, path)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
