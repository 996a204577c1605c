"""MoE expert layer across common shapes: fast_experts (bf16, FP8) against the naive pipeline, one table.

Run on one GPU:  PYTHONUNBUFFERED=1 python benchmarks/moe_shapes.py --out $OUT
Smoke run on CPU (fp32, tiny, no FP8; checks the script itself):
    TRITON_INTERPRET=1 python benchmarks/moe_shapes.py --smoke --out /tmp/moe_shapes_smoke
Each shape is one MoE layer as benchmarks/moe_layer.py builds it (router linear + softmax + top-k + experts; tokens
N(0,1), router and expert weights N(0,0.02)), with the expert implementations on the same tokens and router: ours
bf16, ours FP8 (sm90 only; the weights quantized in every call, and reused as by every pass but the first of a
training step), ours bf16 with the expert weights' gradients added to .grad buffers inside the backward (the
trainer's model.moe.grad_accumulation_fusion) eager and replayed from CUDA graphs (model.moe.cuda_graph,
kernels/moe_graph.py), and the naive pipeline (argsort + gather + 3x torch._grouped_mm + index_add) in bf16.
--only picks shapes by name; --set models runs published models' expert shapes instead (model_shapes()); --shape
T,D,F,E,K (repeatable) runs the shapes given instead, for a layer checked at shapes of one's own choosing.
Each row is checked first (relative L2 error of y and of every gradient vs the naive row; bf16 <= 1e-2, FP8 <= 1e-1),
then timed as forward + y.backward(dy) (triton.testing.do_bench, median ms). On CUDA each row also gives the peak
memory one call holds above the inputs, weights and gradient buffers.
FLOPs counted: 3 matmuls x 2*D*F per routed (token, expert) pair x 3 (fwd + bwd), whatever the routing's balance.
MFU is given against the spec peak of the row's precision and beside the dense rate measured in this run (bf16: an
8192^3 matmul; FP8: an 8192^3 row-scaled torch._scaled_mm); FP8 rows against the mix they run (moe_layer.py
fp8_layer_rate: 2/3 of the FLOPs FP8, the bf16 weight gradients 1/3). Speed-ups are over the bf16 naive row of the
same shape.
--profile adds, for our rows, the CUDA time per kernel (torch.profiler) and its sum beside the timed wall time: a
sum well below the wall time means the device waits for the host's launches; and for every row the host time to queue
one call, with the Python functions that take it (cProfile).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
import traceback
from dataclasses import asdict, dataclass

import torch
from moe_layer import (
    SPEC_TFLOPS,
    Dims,
    bench,
    dense_bf16_tflops,
    file_log,
    fp8_layer_rate,
    make_layer,
    naive_experts,
    rel,
    route,
)
from moe_layer_fp8 import dense_fp8_tflops, kernel_breakdown

OURS_BF16, OURS_FP8, NAIVE = "ours bf16", "ours FP8", "naive bf16"
# FP8 inside kernels.fp8_weights.reuse_weights(): every pass after the first of a step (further micro-batches, a
# recomputed forward) finds the weights quantized; timed inside one scope, the first call fills it
OURS_FP8_REUSED = "ours FP8, weights reused"
# the trainer's configuration (model.moe.grad_accumulation_fusion): the expert weights' gradients added to .grad
# buffers that stay allocated, inside the backward; eager, and replayed from CUDA graphs (model.moe.cuda_graph)
OURS_INTO, OURS_GRAPH = "ours bf16, grads into .grad", "ours bf16, grads into .grad, CUDA graph"
# their baseline: the naive pipeline with .grad allocated, so that autograd adds each gradient to it, as it does in
# every micro-batch of the trainer (whose gradient buffers the optimizer zeroes rather than frees)
NAIVE_INTO = "naive bf16, grads added to .grad"
ROW_KEYS = {"bf16": OURS_BF16, "fp8": OURS_FP8, "fp8-reused": OURS_FP8_REUSED, "into": OURS_INTO,
            "graph": OURS_GRAPH}  # --rows
BASELINES = (NAIVE, NAIVE_INTO)
TOL = {OURS_BF16: 1e-2, OURS_FP8: 1e-1, OURS_FP8_REUSED: 1e-1, OURS_INTO: 1e-2, OURS_GRAPH: 1e-2}


@dataclass
class Shape:
    name: str
    dims: Dims
    hot: int = 0  # experts given a fixed router-logit bias of hot_bias: the skewed-routing case
    hot_bias: float = 0.0


def model_shapes() -> list[Shape]:
    """`--set models`: published MoE models' expert shapes, none of them the shapes above nor tuned for; dims as
    their configs give them (a model too large for one GPU with fewer experts, as on one rank of an expert-parallel
    run), plus token counts that are not powers of two."""
    return [
        Shape("DeepSeek-V2-Lite: F 1408, top-6", Dims(T=16384, D=2048, F=1408, E=64, K=6)),
        Shape("Qwen2-57B-A14B: D 3584, F 2560", Dims(T=8192, D=3584, F=2560, E=64, K=8)),
        Shape("gpt-oss-20b: D 2880, 32 experts, top-4", Dims(T=16384, D=2880, F=2880, E=32, K=4)),
        Shape("Mixtral-8x22B: D 6144, F 16384, top-2", Dims(T=4096, D=6144, F=16384, E=8, K=2)),
        Shape("DeepSeek-V3 expert dims: D 7168, F 2048, 32 experts", Dims(T=4096, D=7168, F=2048, E=32, K=8)),
        Shape("odd token count: T 3000 (OLMoE dims)", Dims(T=3000, D=2048, F=1024, E=64, K=8)),
        Shape("few tokens: T 2048 (OLMoE dims)", Dims(T=2048, D=2048, F=1024, E=64, K=8)),
    ]


def parse_shape(text: str) -> Shape:
    """`--shape T,D,F,E,K`: tokens, model dim, expert hidden size, experts, top-k. Pure; ValueError names the fault."""
    parts = text.replace(" ", "").split(",")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shape takes five positive integers T,D,F,E,K (tokens, model dim, expert hidden size, "
                         f"experts, top-k), got {text!r}")
    T, D, F, E, K = map(int, parts)
    if K > E:
        raise ValueError(f"--shape {text!r}: top-k {K} is more than the {E} experts")
    return Shape(f"T {T}, D {D}, F {F}, {E} experts, top-{K}", Dims(T=T, D=D, F=F, E=E, K=K))


def shapes(smoke: bool, which: str = "common") -> list[Shape]:
    if which == "models" and not smoke:
        return model_shapes()
    olmoe = Dims(T=16384, D=2048, F=1024, E=64, K=8)
    full = [
        Shape("OLMoE-1B-7B (anchor)", olmoe),
        Shape("coarse: 8 large experts, top-2 (Mixtral-8x7B-like)", Dims(T=8192, D=4096, F=14336, E=8, K=2)),
        Shape("fine: 128 experts, top-8 (Qwen3-30B-A3B-like)", Dims(T=16384, D=2048, F=768, E=128, K=8)),
        Shape("very fine: 256 small experts, top-8", Dims(T=16384, D=2048, F=512, E=256, K=8)),
        Shape("skewed: 4 hot experts (OLMoE dims)", olmoe, hot=4, hot_bias=3.0),
        Shape("one micro-batch: T 8192 (OLMoE dims)", Dims(T=8192, D=2048, F=1024, E=64, K=8)),
        Shape("few tokens: T 4096 (OLMoE dims)", Dims(T=4096, D=2048, F=1024, E=64, K=8)),
        Shape("few tokens: T 1024 (OLMoE dims)", Dims(T=1024, D=2048, F=1024, E=64, K=8)),
    ]
    if not smoke:
        return full
    tiny = [Dims(T=64, D=32, F=16, E=8, K=2), Dims(T=32, D=32, F=64, E=4, K=2), Dims(T=64, D=32, F=8, E=16, K=4),
            Dims(T=64, D=32, F=8, E=32, K=4), Dims(T=64, D=32, F=16, E=8, K=2), Dims(T=48, D=32, F=16, E=8, K=2),
            Dims(T=32, D=32, F=16, E=8, K=2), Dims(T=16, D=32, F=16, E=8, K=2)]
    return [Shape(s.name, d, s.hot, s.hot_bias) for s, d in zip(full, tiny)]


def expert_flops(d: Dims) -> int:
    return 3 * 2 * d.D * d.F * d.T * d.K * 3


def load_stats(x_TD, router_ED, bias_E, d: Dims, hot: int) -> dict:
    """How unevenly the router spreads the T*K pairs: max/mean expert load, share of the hot experts, idle experts."""
    with torch.no_grad():
        _, idx_TK = route(x_TD, router_ED, d.K, bias_E)
        counts_E = torch.bincount(idx_TK.reshape(-1), minlength=d.E).float()
    return {"max_over_mean": (counts_E.max() / counts_E.mean()).item(),
            "hot_share": (counts_E[:hot].sum() / counts_E.sum()).item() if hot else None,
            "idle_experts": int((counts_E == 0).sum())}


def run_shape(shape: Shape, device, dtype, fp8: bool, rep_ms: int, log, profile: bool = False,
              gemm_impl: str = "auto", rows: list[str] | None = None) -> dict:
    from moe_launch.kernels.fp8_weights import reuse_weights
    from moe_launch.kernels.moe import fast_experts
    from moe_launch.kernels.moe_graph import ExpertGraphs

    d = shape.dims
    torch.manual_seed(0)
    x_TD = torch.randn(d.T, d.D, device=device, dtype=dtype)
    dy_TD = torch.randn_like(x_TD)
    params = [(torch.randn(*s, device=device) * 0.02).to(dtype).requires_grad_()
              for s in ((d.E, d.D), (d.E, d.F, d.D), (d.E, d.F, d.D), (d.E, d.D, d.F))]
    bias_E = None
    if shape.hot:
        bias_E = torch.zeros(d.E, device=device, dtype=dtype)
        bias_E[:shape.hot] = shape.hot_bias
    res = {"dims": asdict(d), "flops": expert_flops(d), "load": load_stats(x_TD, params[0], bias_E, d, shape.hot),
           "rows": {}}
    log(f"{shape.name}: {asdict(d)} load {res['load']}")
    ours = {"bias_E": bias_E, "gemm_impl": gemm_impl}
    layers = {OURS_BF16: make_layer(fast_experts, params, d.K, **ours)}
    if fp8:
        layers[OURS_FP8] = layers[OURS_FP8_REUSED] = make_layer(fast_experts, params, d.K, precision="fp8", **ours)
    layers[OURS_INTO] = make_layer(fast_experts, params, d.K, fuse_grad_accumulation=True, **ours)
    graphs = ExpertGraphs()
    layers[OURS_GRAPH] = make_layer(fast_experts, params, d.K, fuse_grad_accumulation=True, graphs=graphs, **ours)
    layers[NAIVE] = layers[NAIVE_INTO] = make_layer(naive_experts, params, d.K, bias_E=bias_E)
    if rows:  # the naive rows stay: every row is checked against the first, and compared with its like
        layers = {k: v for k, v in layers.items() if k in BASELINES or any(ROW_KEYS[r] == k for r in rows)}

    def fwd_bwd(layer):
        xx = x_TD.detach().requires_grad_()
        y = layer(xx)
        return [y.detach(), *torch.autograd.grad(y, [xx, *params], dy_TD)]

    # correctness first: every row vs the naive one on the same tokens and router
    base = fwd_bwd(layers[NAIVE])
    for name, layer in layers.items():
        row = res["rows"][name] = {}
        if name in BASELINES:
            continue
        try:
            with reuse_weights() if name == OURS_FP8_REUSED else contextlib.nullcontext() as scope:
                outs = fwd_bwd(layer)
                if scope is not None:  # the second pass is the one that reuses
                    outs = fwd_bwd(layer)
                    row["reuse_hits"] = scope.hits
            row["err_y"] = rel(outs[0], base[0])
            row["err_grads"] = max(rel(a, b) for a, b in zip(outs[1:], base[1:]))
            del outs
            tol = 1e-5 if dtype == torch.float32 else TOL[name]
            row["ok"] = max(row["err_y"], row["err_grads"]) <= tol
            log(f"  check {name}: y {row['err_y']:.1e}, grads {row['err_grads']:.1e} "
                + ("OK" if row["ok"] else f"ABOVE TOLERANCE {tol:.0e}"))
        except Exception as e:  # noqa: BLE001  (report the row and continue: the table must print)
            row["error"] = f"{type(e).__name__}: {e}"[:200]
            log(f"  check {name} failed: {e!r}\n{traceback.format_exc()}"[:1500])
    del base

    for name, layer in layers.items():
        row = res["rows"][name]
        if "error" in row:
            continue

        into = name in (OURS_INTO, OURS_GRAPH, NAIVE_INTO)
        for p in params:  # rows adding into .grad find it allocated (its values do not matter to the timing)
            p.grad = torch.zeros_like(p) if into else None

        def step(layer=layer, into=into):
            if not into:
                for p in params:
                    p.grad = None
            layer(x_TD.detach().requires_grad_()).backward(dy_TD)

        try:
            with reuse_weights() if name == OURS_FP8_REUSED else contextlib.nullcontext():
                if device.type == "cuda":  # what one call holds above the inputs, weights and .grad buffers
                    step()
                    torch.cuda.synchronize()
                    held = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    step()
                    row["peak_mib"] = (torch.cuda.max_memory_allocated() - held) / 2**20
                row["ms"] = bench(step, device, rep_ms=rep_ms)
                row["tflops"] = res["flops"] / row["ms"] / 1e9
                log(f"  timed {name}: {row['ms']:.3f} ms fwd+bwd, {row['tflops']:.0f} TFLOP/s")
                # in the same scope as the timing: the reused weights' row runs no weight quantization here either
                if profile and device.type == "cuda" and name not in BASELINES:
                    # kernel time against the timed wall time: what is left is the device waiting for the host
                    kernels = kernel_breakdown(step, log, label=f"{shape.name} / {name}", top=10)
                    row["kernel_ms"] = sum(ms for ms, _ in kernels.values())
                    row["launches"] = sum(n for _, n in kernels.values())
                    log(f"  {name}: kernels {row['kernel_ms']:.3f} ms of {row['ms']:.3f} ms, {row['launches']} "
                        "launches")
                if profile and device.type == "cuda":
                    row["host_ms"] = host_breakdown(step, log, label=name)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:200]
            log(f"  timing {name} failed: {e!r}"[:1500])
    res["graphs_captured"] = len(graphs.graphs)
    graphs.clear()
    for p in params:
        p.grad = None
    return res


def host_breakdown(step, log, label: str = "", iters: int = 20, top: int = 12) -> float:
    """Host time of one step (the time to queue it, the device idle at the start), and where it goes: the Python
    functions with the most own time under cProfile. Host time near the timed wall time means launch-bound."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    host_ms = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    log(f"  {label} host time per call: {host_ms:.3f} ms; own time per call under cProfile (ms, calls):")
    for (file, line, fn), (_, ncalls, tottime, _, _) in rows:
        log(f"    {tottime / iters * 1e3:7.3f} ms  x{ncalls // iters:<4d} {fn} ({os.path.basename(file)}:{line})")
    return host_ms


def table(results: dict, dense: dict) -> list[str]:
    lines = [f"dense rates measured in this run: bf16 {dense['bf16']:.0f}, FP8 {dense['fp8']:.0f} TFLOP/s; spec "
             f"(H100/H200 SXM): bf16 {SPEC_TFLOPS['bf16']:.0f}, FP8 {SPEC_TFLOPS['fp8']:.0f}",
             "| shape | T, D, F, E, top-k | load max/mean | impl | fwd+bwd ms (median) | expert TFLOP/s | MFU vs spec "
             "| % of measured dense | speed-up vs naive bf16 (same grad handling) | max rel err vs naive (y / grads) "
             "| peak MiB above the inputs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        if "error" in res:
            lines.append(f"| {name} | | | | ERROR {res['error']} | | | | | | |")
            continue
        d, load = res["dims"], res["load"]
        dims = f"{d['T']}, {d['D']}, {d['F']}, {d['E']}, {d['K']}"
        skew = f"{load['max_over_mean']:.1f}" + (f" (hot {100 * load['hot_share']:.0f}%)" if load["hot_share"] else "")
        naive_ms = {NAIVE: res["rows"][NAIVE].get("ms"), NAIVE_INTO: res["rows"][NAIVE_INTO].get("ms")}
        for impl, row in res["rows"].items():
            head = f"| {name} | {dims} | {skew} | {impl} |"
            if "error" in row:
                lines.append(f"{head} ERROR {row['error']} | | | | | | |")
                continue
            if impl in (OURS_FP8, OURS_FP8_REUSED):  # against the mix of precisions the FP8 layer runs
                spec = fp8_layer_rate(SPEC_TFLOPS["fp8"], SPEC_TFLOPS["bf16"])
                measured = fp8_layer_rate(dense["fp8"], dense["bf16"])
            else:
                spec, measured = SPEC_TFLOPS["bf16"], dense["bf16"]
            row["mfu_spec"], row["of_measured_dense"] = row["tflops"] / spec, row["tflops"] / measured
            base_ms = naive_ms[NAIVE_INTO if impl in (OURS_INTO, OURS_GRAPH, NAIVE_INTO) else NAIVE]
            row["speedup"] = base_ms / row["ms"] if base_ms else float("nan")
            err = "baseline" if impl in BASELINES else (f"{row['err_y']:.1e} / {row['err_grads']:.1e}"
                                                    + ("" if row["ok"] else " ABOVE TOL"))
            lines.append(f"{head} {row['ms']:.3f} | {row['tflops']:.0f} | {100 * row['mfu_spec']:.0f}% of {spec:.0f} "
                         f"| {100 * row['of_measured_dense']:.0f}% of {measured:.0f} | {row['speedup']:.2f}x "
                         f"| {err} | {row.get('peak_mib', float('nan')):.0f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 CPU run of the script's own logic")
    ap.add_argument("--rep-ms", type=int, default=500, help="do_bench measuring time per row")
    ap.add_argument("--set", dest="which", choices=("common", "models"), default="common",
                    help="common: the common shapes; models: published models' expert shapes (--smoke: the same "
                         "tiny shapes either way)")
    ap.add_argument("--shape", action="append", default=[], metavar="T,D,F,E,K",
                    help="run this shape (repeatable) instead of a set: tokens, model dim, expert hidden size, "
                         "experts, top-k")
    ap.add_argument("--only", default="", help="comma-separated substrings: run the shapes whose name has one")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel CUDA time of our rows (torch.profiler) beside the timed wall time")
    ap.add_argument("--rows", default="", help="comma-separated, of " + ", ".join(ROW_KEYS)
                    + ": our rows to run (default all); the naive rows always run")
    ap.add_argument("--gemm-impl", default="auto", choices=("auto", "torch", "tma"),
                    help="the row GEMMs of our rows: auto (the layer's choice per shape), torch (CUTLASS) or tma (our "
                         "persistent TMA kernel)")
    args = ap.parse_args()
    if any(r not in ROW_KEYS for r in args.rows.split(",") if r):
        ap.error(f"--rows takes names of {sorted(ROW_KEYS)}, got {args.rows!r}")
    try:
        given = [parse_shape(s) for s in args.shape]
    except ValueError as e:
        ap.error(str(e))
    which = "given" if given else args.which
    stem = "moe_shapes" + ("" if which == "common" else f"-{which}") + (
        "" if args.gemm_impl == "auto" else f"-{args.gemm_impl}")
    log = file_log(args.out, f"{stem}.log")

    import triton

    from moe_launch.kernels.fp8 import fp8_gemm_supported

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    fp8 = fp8_gemm_supported(device)
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "gemm_impl": args.gemm_impl,
           "triton": triton.__version__, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "fp8_rows": fp8}
    log(json.dumps(env))
    dense = {"bf16": float("nan"), "fp8": float("nan")}
    if device.type == "cuda":
        dense["bf16"] = dense_bf16_tflops(device)
        if fp8:
            try:
                dense["fp8"] = dense_fp8_tflops(device)
            except Exception as e:  # noqa: BLE001
                log(f"dense FP8 GEMM failed: {e!r}"[:400])
        torch.cuda.empty_cache()
    log(f"dense bf16 8192^3: {dense['bf16']:.0f} TFLOP/s, dense FP8 8192^3: {dense['fp8']:.0f} TFLOP/s")

    results = {}
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    chosen = given or shapes(args.smoke, args.which)
    for shape in (s for s in chosen if not wanted or any(w in s.name for w in wanted)):
        t0 = time.perf_counter()
        try:
            results[shape.name] = run_shape(shape, device, dtype, fp8, args.rep_ms, log, args.profile,
                                            args.gemm_impl, [r for r in args.rows.split(",") if r])
        except Exception as e:  # noqa: BLE001  (an OOM or a crash is one row of the table, not the end of the run)
            results[shape.name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            log(f"{shape.name} failed: {e!r}\n{traceback.format_exc()}"[:2000])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"  ({time.perf_counter() - t0:.1f} s)")

    log("")
    for line in table(results, dense):
        log(line)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump({"env": env, "spec_tflops": SPEC_TFLOPS, "dense_tflops": dense, "shapes": results}, f, indent=1,
                  default=str)


if __name__ == "__main__":
    main()
