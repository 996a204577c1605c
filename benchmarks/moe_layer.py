"""MoE layer forward+backward benchmark: FastSparseMoE kernels against the reference layer and HF OLMoE.

Run on one GPU:  PYTHONUNBUFFERED=1 python benchmarks/moe_layer.py --out $OUT
Smoke run on CPU (fp32, tiny, checks the script itself):  python benchmarks/moe_layer.py --smoke
Each row is one MoE layer (router linear + softmax + top-k + experts) on the same tokens and the same router:
correctness is checked first (relative L2 error vs our reference layer, bf16 <= 1e-2), then timed with
triton.testing.do_bench (median ms). FLOPs counted: 3 matmuls x 2*d*F per (token, expert) x top-k x 3 (fwd + bwd).
The FP8 row (fast_experts precision="fp8") is held to 1e-1 against the same bf16 reference; its MFU is given against
the peak and the measured dense rate of its precision mix (fp8_layer_rate: 2/3 of its FLOPs FP8, 1/3 bf16), the bf16
rows' against the bf16 ones (SPEC_TFLOPS, H100 and H200 SXM).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SPEC_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # H100 and H200 SXM dense, vendor data sheets (the same)


def fp8_layer_rate(fp8: float, bf16: float) -> float:
    """The rate the FP8 expert layer's FLOPs would run at if each part ran at `fp8` / `bf16`: two thirds of them are
    FP8 GEMMs (forward, activation gradients), one third bf16 (weight gradients, kernels/moe.py)."""
    return 1.0 / ((2.0 / 3.0) / fp8 + (1.0 / 3.0) / bf16)
FP8_ROW = "ours fast FP8 (torch._scaled_grouped_mm fwd + dgrad, bf16 wgrad)"


@dataclass
class Dims:
    T: int = 16384
    D: int = 2048
    F: int = 1024
    E: int = 64
    K: int = 8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def route(x_TD, router_ED, K, bias_E=None):
    """OLMoE router (norm_topk_prob=False), as HF's OlmoeTopKRouter computes it. bias_E (a fixed logit offset per
    expert) skews the load toward chosen experts."""
    logits = F.linear(x_TD, router_ED, bias_E)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w_TK, idx_TK = torch.topk(probs, K, dim=-1)
    return w_TK.to(logits.dtype), idx_TK


def make_layer(experts_fn, params, K, uniform=False, bias_E=None, **kw):
    router_ED, wg, wu, wd = params

    def layer(x_TD):
        w_TK, idx_TK = route(x_TD, router_ED, K, bias_E)
        if uniform:  # forced perfectly balanced routing: token t uses experts (t*K + k) mod E
            T, E = x_TD.shape[0], wg.shape[0]
            idx_TK = (torch.arange(T, device=x_TD.device)[:, None] * K + torch.arange(K, device=x_TD.device)) % E
        return experts_fn(x_TD, idx_TK, w_TK, wg, wu, wd, **kw)

    return layer


def naive_experts(x_TD, idx_TK, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, e_start=0):
    """The naive pipeline baseline: argsort + gather + 3x torch._grouped_mm + index_add, plain autograd."""
    T, K = idx_TK.shape
    flat = idx_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(torch.bincount(flat, minlength=w_gate_EFD.shape[0]), 0).to(torch.int32)
    tok = order // K
    xs = x_TD[tok]
    g = torch._grouped_mm(xs, w_gate_EFD.transpose(1, 2), offs=ends)
    u = torch._grouped_mm(xs, w_up_EFD.transpose(1, 2), offs=ends)
    y = torch._grouped_mm(F.silu(g) * u, w_down_EDF.transpose(1, 2), offs=ends)
    return torch.zeros_like(x_TD).index_add(0, tok, y * w_TK.reshape(-1)[order, None])


def dense_bf16_tflops(device, n: int = 8192) -> float:
    """An n^3 bf16 matmul: the dense rate the expert GEMMs are held against."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench(lambda: a @ a, device)
    return 2 * n**3 / ms / 1e9


def sync_free_check(params, x_TD, K, log, precision="bf16"):
    """fast_experts forward+backward under torch.cuda.set_sync_debug_mode('error'): any host sync raises."""
    from moe_launch.kernels.moe import fast_experts

    router_ED, wg, wu, wd = params
    w_TK, idx_TK = route(x_TD, router_ED, K)
    w_TK = w_TK.detach().requires_grad_()
    xx = x_TD.detach().requires_grad_()
    y = fast_experts(xx, idx_TK, w_TK, wg, wu, wd, precision=precision)  # warm-up: Triton compiles (and may sync)
    torch.autograd.grad(y, [xx, w_TK, wg, wu, wd], torch.ones_like(y))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = fast_experts(xx, idx_TK, w_TK, wg, wu, wd, precision=precision)
        torch.autograd.grad(y, [xx, w_TK, wg, wu, wd], torch.ones_like(y))
        ok = True
    except Exception as e:  # noqa: BLE001
        ok = f"sync detected: {e!r}"[:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    log(f"  check no host sync in fast_experts fwd+bwd ({precision}): {ok}")
    return ok


def hf_block(params, dims: Dims, impl: str, dtype, device):
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    cfg = OlmoeConfig(hidden_size=dims.D, intermediate_size=dims.F, num_experts=dims.E, num_experts_per_tok=dims.K,
                      norm_topk_prob=False)
    cfg._experts_implementation = impl
    blk = OlmoeSparseMoeBlock(cfg).to(device=device, dtype=dtype)
    router_ED, wg, wu, wd = params
    with torch.no_grad():
        blk.gate.weight.copy_(router_ED)
        blk.experts.gate_up_proj.copy_(torch.cat([wg, wu], dim=1))
        blk.experts.down_proj.copy_(wd)
    return blk, cfg._experts_implementation


def bench(fn, device, rep_ms=1000):
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=200, rep=rep_ms, return_mode="median")


def peak_mib(fn, device):
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def kernel_checks(device, log):
    """Each kernel against its torch reference on this device (small sizes, zero-token experts, sub-range)."""
    from moe_launch.kernels import gather, grouped_gemm, reduce, swiglu
    from moe_launch.kernels.index_gen import route_indices
    from moe_launch.kernels.moe import fast_experts
    from moe_launch.trainer.moe.reference import experts_reference

    g = torch.Generator(device="cpu").manual_seed(1)
    T, D, Fh, E_glob, K, e0, e1 = 777, 256, 128, 64, 8, 16, 48
    # experts 16..23 never chosen: zero-token experts inside the local range
    pool = torch.tensor([e for e in range(E_glob) if not 16 <= e < 24])
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)]).to(device)
    out = {}
    a, b = route_indices(idx, e0, e1), route_indices(idx, e0, e1, impl="reference")
    out["route_indices_exact"] = all(torch.equal(getattr(a, f), getattr(b, f)) for f in
                                     ("counts_E", "offsets_E1", "row_token_N", "row_pair_N", "pair_row_TK"))
    R = int(a.num_rows)
    for dt in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dt == torch.float32 else 1e-2
        x = torch.randn(T, D, generator=g).to(device, dt)
        xr = gather.gather_rows(x, a.row_token_N, a.num_rows)
        out[f"gather_{dt}"] = torch.equal(xr[:R], gather.gather_rows_reference(x, a.row_token_N, a.num_rows)[:R])
        E = e1 - e0
        wg = (torch.randn(E, Fh, D, generator=g) / D**0.5).to(device, dt)
        wu = (torch.randn(E, Fh, D, generator=g) / D**0.5).to(device, dt)
        wd = (torch.randn(E, D, Fh, generator=g) / Fh**0.5).to(device, dt)
        ref = grouped_gemm.grouped_mm(xr, wg.transpose(1, 2), a, "reference")[:R]
        for impl in ("triton", "torch") if dt == torch.bfloat16 else ("triton",):
            try:
                c = grouped_gemm.grouped_mm(xr, wg.transpose(1, 2), a, impl)[:R]
                out[f"gmm_{impl}_{dt}"] = rel(c, ref) <= tol
                dg = torch.randn(xr.shape[0], Fh, generator=g).to(device, dt)
                wref = grouped_gemm.grouped_mm_wgrad(dg, xr, a, "reference")
                w = grouped_gemm.grouped_mm_wgrad(dg, xr, a, impl)
                out[f"wgrad_{impl}_{dt}"] = rel(w, wref) <= tol
                out[f"wgrad_{impl}_{dt}_zero_experts_exact0"] = bool((w[:8] == 0).all())
            except Exception as e:  # noqa: BLE001  (report and continue: the benchmark must print its table)
                out[f"gmm_{impl}_{dt}"] = f"ERROR {e!r}"[:200]
        gg, uu = torch.randn(2, xr.shape[0], Fh, generator=g).to(device, dt)
        out[f"swiglu_fwd_{dt}"] = rel(swiglu.swiglu_fwd(gg, uu, a.num_rows)[:R],
                                      swiglu.swiglu_fwd_reference(gg, uu, a.num_rows)[:R]) <= tol
        wtk = torch.rand(T, K, generator=g).to(device, dt)
        routing = (wtk, a.row_pair_N)
        dgs = swiglu.swiglu_bwd(gg, uu, gg, a.num_rows, routing=routing)
        rgs = swiglu.swiglu_bwd_reference(gg, uu, gg, a.num_rows, routing=routing)
        out[f"swiglu_bwd_{dt}"] = (all(rel(p[:R], q[:R]) <= tol for p, q in zip(dgs[:3], rgs[:3]))
                                   and rel(dgs[3], rgs[3]) <= tol)
        out[f"combine_fwd_{dt}"] = rel(reduce.combine(xr, a.pair_row_TK, wtk),
                                       reduce.combine_reference(xr, a.pair_row_TK, wtk)) <= tol
        dy = torch.randn(T, D, generator=g).to(device, dt)
        # whole layer with both GEMM paths, sub-range of experts and zero-token experts
        for impl in ("triton", "torch") if dt == torch.bfloat16 else ("triton",):
            try:
                ps = [t.clone().requires_grad_() for t in (x, wtk, wg, wu, wd)]
                y = fast_experts(ps[0], idx, ps[1], *ps[2:], e_start=e0, gemm_impl=impl)
                gr = torch.autograd.grad(y, ps, dy)
                qs = [t.clone().requires_grad_() for t in (x, wtk, wg, wu, wd)]
                yr = experts_reference(qs[0], idx, qs[1], *qs[2:], e_start=e0)
                grr = torch.autograd.grad(yr, qs, dy)
                errs = [rel(y, yr)] + [rel(p, q) for p, q in zip(gr, grr)]
                out[f"layer_{impl}_{dt}"] = (max(errs) <= tol, [f"{v:.1e}" for v in errs])
            except Exception as e:  # noqa: BLE001
                out[f"layer_{impl}_{dt}"] = f"ERROR {e!r}"[:300]
    # autocast: fp32 master weights, bf16 compute (torch grouped_mm path), fp32 gradients; vs fp32 evaluation of the
    # bf16-rounded inputs
    try:
        E = e1 - e0
        ts = [torch.randn(T, D, generator=g), torch.rand(T, K, generator=g), torch.randn(E, Fh, D, generator=g) / 16,
              torch.randn(E, Fh, D, generator=g) / 16, torch.randn(E, D, Fh, generator=g) / 11]
        ps = [t.to(device).requires_grad_() for t in ts]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fast_experts(ps[0], idx, ps[1], *ps[2:], e_start=e0)
        gr = torch.autograd.grad(y.float().sum(), ps)
        qs = [(t.to(device).bfloat16().float() if i != 1 else t.to(device)).requires_grad_() for i, t in enumerate(ts)]
        yr = experts_reference(qs[0], idx, qs[1], *qs[2:], e_start=e0)
        grr = torch.autograd.grad(yr.sum(), qs)
        errs = [rel(y, yr)] + [rel(p, q) for p, q in zip(gr, grr)]
        out["layer_autocast_bf16_fp32_masters"] = (max(errs) <= 1e-2 and y.dtype == torch.bfloat16
                                                   and all(t.dtype == torch.float32 for t in gr),
                                                   [f"{v:.1e}" for v in errs])
    except Exception as e:  # noqa: BLE001
        out["layer_autocast_bf16_fp32_masters"] = f"ERROR {e!r}"[:300]
    for k, v in out.items():
        log(f"  check {k}: {v}")
    return out


def stage_timings(params, x_TD, dims: Dims, device, log):
    """Each stage alone, on the realistic routing, forward and backward (ms, median)."""
    from moe_launch.kernels import gather, grouped_gemm, reduce, swiglu
    from moe_launch.kernels.index_gen import route_indices

    router_ED, wg, wu, wd = params
    w_TK, idx_TK = route(x_TD, router_ED, dims.K)
    plan = route_indices(idx_TK, 0, dims.E)
    x_ND = gather.gather_rows(x_TD, plan.row_token_N, plan.num_rows)
    g_NF = grouped_gemm.grouped_mm(x_ND, wg.transpose(1, 2), plan)
    u_NF = grouped_gemm.grouped_mm(x_ND, wu.transpose(1, 2), plan)
    h_NF = swiglu.swiglu_fwd(g_NF, u_NF, plan.num_rows)
    y_ND = grouped_gemm.grouped_mm(h_NF, wd.transpose(1, 2), plan)
    dy_TD = torch.randn_like(x_TD)
    dy_ND = gather.gather_rows(dy_TD, plan.row_token_N, plan.num_rows)
    wgu = torch.cat([wg, wu], dim=1)
    gu_N2F = torch.cat([g_NF, u_NF], dim=1)
    stages = {
        "fwd router (linear+softmax+topk)": lambda: route(x_TD, router_ED, dims.K),
        "fwd route_indices (count+index)": lambda: route_indices(idx_TK, 0, dims.E),
        "fwd gather": lambda: gather.gather_rows(x_TD, plan.row_token_N, plan.num_rows),
        "fwd gmm gate": lambda: grouped_gemm.grouped_mm(x_ND, wg.transpose(1, 2), plan),
        "fwd gmm up": lambda: grouped_gemm.grouped_mm(x_ND, wu.transpose(1, 2), plan),
        "fwd swiglu": lambda: swiglu.swiglu_fwd(g_NF, u_NF, plan.num_rows),
        "fwd gmm down": lambda: grouped_gemm.grouped_mm(h_NF, wd.transpose(1, 2), plan),
        "fwd combine": lambda: reduce.combine(y_ND, plan.pair_row_TK, w_TK),
        "bwd gather dy rows": lambda: gather.gather_rows(dy_TD, plan.row_token_N, plan.num_rows),
        "bwd gmm dh": lambda: grouped_gemm.grouped_mm(dy_ND, wd, plan),
        "bwd swiglu (dg, du, w*h, dw)": lambda: swiglu.swiglu_bwd(g_NF, u_NF, h_NF, plan.num_rows,
                                                                  routing=(w_TK, plan.row_pair_N)),
        "bwd wgrad down": lambda: grouped_gemm.grouped_mm_wgrad(dy_ND, h_NF, plan),
        "bwd wgrad gate": lambda: grouped_gemm.grouped_mm_wgrad(g_NF, x_ND, plan),
        "bwd wgrad up": lambda: grouped_gemm.grouped_mm_wgrad(u_NF, x_ND, plan),
        "bwd gmm dx gate": lambda: grouped_gemm.grouped_mm(g_NF, wg, plan),
        "bwd gmm dx up": lambda: grouped_gemm.grouped_mm(u_NF, wu, plan),
        "bwd combine dx (2 bufs)": lambda: reduce.combine(x_ND, plan.pair_row_TK, None, rows2_ND=x_ND),
        # variants, not in the layer: fused gate+up (one GEMM with 2F outputs; one dx GEMM with K=2F)
        "variant: cat weights gate+up": lambda: torch.cat([wg, wu], dim=1),
        "variant: gmm gate+up fused": lambda: grouped_gemm.grouped_mm(x_ND, wgu.transpose(1, 2), plan),
        "variant: gmm dx fused K=2F": lambda: grouped_gemm.grouped_mm(gu_N2F, wgu, plan),
        "variant: gmm gate (triton)": lambda: grouped_gemm.grouped_mm(x_ND, wg.transpose(1, 2), plan, "triton"),
        "variant: wgrad gate (triton)": lambda: grouped_gemm.grouped_mm_wgrad(g_NF, x_ND, plan, "triton"),
    }
    res = {}
    for name, fn in stages.items():
        try:
            res[name] = bench(fn, device, rep_ms=200)
        except Exception as e:  # noqa: BLE001
            res[name] = float("nan")
            log(f"  stage {name} failed: {e!r}"[:300])
        log(f"  stage {name:40s} {res[name]:8.3f} ms")
    return res


def file_log(out_dir: str, name: str):
    """-> log(msg): print it and append it to out_dir/name, flushed per line (a timeout keeps what was logged)."""
    os.makedirs(out_dir, exist_ok=True)
    logf = open(os.path.join(out_dir, name), "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    return log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 CPU run of the script's own logic")
    args = ap.parse_args()
    log = file_log(args.out, "moe_layer.log")

    import moe_layer_fp8  # beside this script (its folder is on sys.path)

    from moe_launch.kernels.moe import fast_experts
    from moe_launch.trainer.moe.reference import experts_reference

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dims = Dims(T=64, D=32, F=16, E=8, K=2) if args.smoke else Dims()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tol = 1e-5 if args.smoke else 1e-2
    import transformers
    import triton

    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "triton": triton.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    log(json.dumps(env))
    torch.manual_seed(0)
    T, D, Fh, E, K = dims.T, dims.D, dims.F, dims.E, dims.K
    x_TD = torch.randn(T, D, device=device, dtype=dtype)
    params = [(torch.randn(*s, device=device) * 0.02).to(dtype).requires_grad_()
              for s in ((E, D), (E, Fh, D), (E, Fh, D), (E, D, Fh))]
    flops = 3 * 2 * D * Fh * T * K * 3
    results = {"env": env, "dims": dims.__dict__, "flops": flops}

    if not args.smoke:
        log("kernel checks (GPU, each kernel vs its torch reference):")
        results["checks"] = kernel_checks(device, log)
        results["checks"]["no_host_sync"] = sync_free_check(params, x_TD, K, log)
        results["checks"]["no_host_sync_fp8"] = sync_free_check(params, x_TD, K, log, precision="fp8")
        results["fp8_checks"] = moe_layer_fp8.checks(device, log)
        dense_tflops = dense_bf16_tflops(device)
        ms = 2 * 8192**3 / dense_tflops / 1e9
        log(f"dense bf16 GEMM 8192^3: {ms:.3f} ms = {dense_tflops:.0f} TFLOP/s; floor for this layer "
            f"{flops / dense_tflops / 1e9:.2f} ms")
        try:
            dense_fp8 = moe_layer_fp8.dense_fp8_tflops(device)
        except Exception as e:  # noqa: BLE001
            dense_fp8 = float("nan")
            log(f"dense FP8 GEMM failed: {e!r}"[:400])
        log(f"dense FP8 scaled GEMM 8192^3 (row-wise scales, fp32 accumulation): {dense_fp8:.0f} TFLOP/s")
    else:
        dense_tflops = dense_fp8 = float("nan")
    results["dense_tflops"], results["dense_fp8_tflops"] = dense_tflops, dense_fp8

    rows = {
        "ours fast (torch grouped_mm)": make_layer(fast_experts, params, K),
        FP8_ROW: make_layer(fast_experts, params, K, precision="fp8",
                            **({"gemm_impl": "reference"} if args.smoke else {})),
        "ours fast (triton gemm)": make_layer(fast_experts, params, K, gemm_impl="triton"),
        "ours reference layer": make_layer(experts_reference, params, K),
        "naive pipeline (argsort+gather+3x torch._grouped_mm+index_add)": make_layer(naive_experts, params, K),
        "ours fast, forced-uniform routing": make_layer(fast_experts, params, K, uniform=True),
    }
    hf_params = {}  # HF blocks hold their own copies of the weights: grads are read from those
    for impl in ("eager", "grouped_mm"):
        try:
            blk, got = hf_block(params, dims, impl, dtype, device)
            log(f"HF OlmoeSparseMoeBlock experts implementation requested {impl}, config says {got}")
            rows[f"HF OlmoeSparseMoeBlock {impl}"] = lambda x, blk=blk: blk(x[None])[0]
            hf_params[f"HF OlmoeSparseMoeBlock {impl}"] = [blk.gate.weight, blk.experts.gate_up_proj,
                                                           blk.experts.down_proj]
        except Exception as e:  # noqa: BLE001
            log(f"HF {impl} unavailable: {e!r}")

    # correctness: every row vs our reference layer on the same tokens and router (the uniform row vs reference on
    # the same forced routing)
    dy_TD = torch.randn_like(x_TD)
    ref_uniform = make_layer(experts_reference, params, K, uniform=True)
    outs = {}
    for name, layer in list(rows.items()) + [("_ref_uniform", ref_uniform)]:
        try:
            xx = x_TD.clone().requires_grad_()
            y = layer(xx)
            if name in hf_params:
                dx, dr, dgu, dd = torch.autograd.grad(y, [xx] + hf_params[name], dy_TD)
                grads = [dx, dr, dgu[:, :Fh], dgu[:, Fh:], dd]
            else:
                grads = torch.autograd.grad(y, [xx] + params, dy_TD)
            outs[name] = (y.detach(), grads)
        except Exception as e:  # noqa: BLE001
            log(f"{name} failed: {e!r}\n{traceback.format_exc()}")
    names = ["y", "dx", "drouter", "dw_gate", "dw_up", "dw_down"]
    checks = {}
    for name in rows:
        if name not in outs:
            continue
        base = outs["_ref_uniform" if "uniform" in name else "ours reference layer"]
        errs = [rel(outs[name][0], base[0])] + [rel(a, b) for a, b in zip(outs[name][1], base[1])]
        checks[name] = dict(zip(names, errs))
        row_tol = 1e-1 if name == FP8_ROW else tol
        log(f"correctness {name}: " + ", ".join(f"{n}={v:.1e}" for n, v in zip(names, errs))
            + ("  OK" if max(errs) <= row_tol else "  ABOVE TOLERANCE"))
    results["correctness"] = checks
    del outs

    timing = {}
    if args.smoke:
        rows.pop("naive pipeline (argsort+gather+3x torch._grouped_mm+index_add)")
    for name, layer in rows.items():
        def step(layer=layer, name=name):
            for p in params + hf_params.get(name, []):
                p.grad = None
            xx = x_TD.detach().requires_grad_()
            layer(xx).backward(dy_TD)

        def fwd(layer=layer):
            with torch.no_grad():
                layer(x_TD)

        try:
            ms = bench(step, device, rep_ms=3000 if "eager" in name else 1500)
            fms = bench(fwd, device, rep_ms=500)
            mem = peak_mib(step, device)
            timing[name] = {"ms": ms, "fwd_ms": fms, "tflops": flops / ms / 1e9, "peak_mib": mem}
            log(f"timed {name}: {ms:.2f} ms fwd+bwd ({fms:.2f} fwd), peak {mem:.0f} MiB")
            if name == FP8_ROW and device.type == "cuda":
                timing[name]["kernels"] = moe_layer_fp8.kernel_breakdown(step, log)
        except Exception as e:  # noqa: BLE001
            log(f"timing {name} failed: {e!r}")
    results["timing"] = timing
    if not args.smoke:
        log("per-stage timings (ms):")
        results["stages"] = stage_timings([p.detach() for p in params], x_TD, dims, device, log)
        results["stages_fp8"] = moe_layer_fp8.stage_timings([p.detach() for p in params], x_TD, dims, device, log)

    log("")
    log(f"dense rates measured in this run: bf16 {dense_tflops:.0f}, FP8 {dense_fp8:.0f} TFLOP/s; "
        f"spec (H100/H200 SXM): bf16 {SPEC_TFLOPS['bf16']:.0f}, FP8 {SPEC_TFLOPS['fp8']:.0f}")
    log("| implementation | fwd+bwd ms (median) | fwd ms | expert TFLOP/s | MFU vs spec | % of measured dense "
        "| peak MiB | max rel err (y, grads) |")
    log("|---|---|---|---|---|---|---|---|")
    for name, t in timing.items():
        err = max(checks.get(name, {"-": float("nan")}).values())
        if name == FP8_ROW:
            spec = fp8_layer_rate(SPEC_TFLOPS["fp8"], SPEC_TFLOPS["bf16"])
            dense = fp8_layer_rate(dense_fp8, dense_tflops)
        else:
            spec, dense = SPEC_TFLOPS["bf16"], dense_tflops
        t["mfu_spec"], t["of_measured_dense"] = t["tflops"] / spec, t["tflops"] / dense
        log(f"| {name} | {t['ms']:.2f} | {t['fwd_ms']:.2f} | {t['tflops']:.0f} | {100 * t['mfu_spec']:.0f}% of "
            f"{spec:.0f} | {100 * t['of_measured_dense']:.0f}% of {dense:.0f} | {t['peak_mib']:.0f} | {err:.1e} |")
    if dense_tflops == dense_tflops:  # not NaN
        for label, rate in (("bf16", dense_tflops), ("FP8", dense_fp8)):
            log(f"| floor: same FLOPs at the measured {label} dense rate | {flops / rate / 1e9:.2f} | | {rate:.0f} "
                f"| | 100% | | |")
        mixed = (2 * flops / 3 / dense_fp8 + flops / 3 / dense_tflops) / 1e9  # 6 of the 9 GEMMs in FP8
        log(f"| floor of the FP8 recipe: 6 GEMMs at the FP8, 3 at the bf16 dense rate | {mixed:.2f} | | | | | | |")
    with open(os.path.join(args.out, "moe_layer.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
