"""The FP8 expert path on the GPU, for benchmarks/moe_layer.py: its checks, the measured dense FP8 rate, and the
costs of its own stages (quantization, gathers, one scaled grouped GEMM) beside the 2d x 2d FP8 grouped GEMM a weight
gradient in FP8 would need.
"""

from __future__ import annotations

import traceback

import torch
from moe_layer import Dims, bench, rel, route


def dense_fp8_tflops(device) -> float:
    """An 8192^3 e4m3 torch._scaled_mm with row-wise scales and fp32 accumulation (the grouped GEMM's recipe)."""
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    sa, sb = torch.rand(n, 1, device=device) + 0.5, torch.rand(1, n, device=device) + 0.5
    ms = bench(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), device)
    return 2 * n**3 / ms / 1e9


def checks(device, log):
    """The FP8 path on this device: quantization kernel vs its torch reference (compiled Triton), the scaled grouped
    GEMM vs its fp32 emulation, the layer vs the emulated layer and vs the bf16 reference, and no host sync."""
    from moe_launch.kernels import fp8
    from moe_launch.kernels.index_gen import route_indices
    from moe_launch.kernels.moe import fast_experts
    from moe_launch.trainer.moe.reference import experts_reference

    g = torch.Generator(device="cpu").manual_seed(2)
    out = {}
    x = (torch.randn(4097, 2048, generator=g) * torch.logspace(-6, 3, 4097)[:, None]).to(device, torch.bfloat16)
    w = torch.randn(8, 1024, 2048, generator=g).to(device, torch.bfloat16)
    for pow2 in (True, False):
        for name, t in (("rows", x), ("weight_channels", w.transpose(1, 2))):
            q, s = fp8.quantize_rows(t, pow2=pow2)
            qr, sr = fp8.quantize_rows_reference(t, pow2=pow2)
            differ = q.view(torch.uint8) != qr.view(torch.uint8)  # (scales equal, codes differing, worst |dq|)
            out[f"quant_{name}_pow2={pow2}"] = (torch.equal(s, sr), int(differ.sum()),
                                                float((q.float() - qr.float()).abs().max()))
    T, D, Fh, E_glob, K, e0, e1 = 777, 256, 128, 64, 8, 16, 48
    pool = torch.tensor([e for e in range(E_glob) if not 16 <= e < 24])  # zero-token experts inside the range
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)]).to(device)
    plan = route_indices(idx, e0, e1)
    R = int(plan.num_rows)
    aq, as_ = fp8.quantize_rows(torch.randn(T * K, D, generator=g).to(device, torch.bfloat16))
    bq, bs = fp8.quantize_operand(torch.randn(e1 - e0, D, Fh, generator=g).to(device, torch.bfloat16))
    try:
        c = fp8.scaled_grouped_mm(aq, as_, bq, bs, plan, "torch")[:R]
        out["scaled_gmm_torch_vs_emulation"] = rel(c, fp8.scaled_grouped_mm(aq, as_, bq, bs, plan, "reference")[:R])
    except Exception as e:  # noqa: BLE001  (report and continue: the benchmark must print its table)
        out["scaled_gmm_torch_vs_emulation"] = f"ERROR {e!r}"[:300]
    ts = [torch.randn(T, D, generator=g), torch.rand(T, K, generator=g), torch.randn(e1 - e0, Fh, D, generator=g) / 8,
          torch.randn(e1 - e0, Fh, D, generator=g) / 8, torch.randn(e1 - e0, D, Fh, generator=g) / 6]
    ts = [t.to(device, torch.bfloat16) for t in ts]
    dy = torch.randn(T, D, generator=g).to(device, torch.bfloat16)

    def run(fn, **kw):
        ps = [t.clone().requires_grad_() for t in ts]
        y = fn(ps[0], idx, ps[1], *ps[2:], e_start=e0, **kw)
        return [y, *torch.autograd.grad(y, ps, dy)]

    try:
        got = run(fast_experts, precision="fp8")
        emu = run(fast_experts, precision="fp8", gemm_impl="reference")
        ref = run(experts_reference)
        out["layer_fp8_vs_emulated"] = [f"{rel(a, b):.1e}" for a, b in zip(got, emu)]
        out["layer_fp8_vs_bf16_reference"] = [f"{rel(a, b):.1e}" for a, b in zip(got, ref)]
    except Exception as e:  # noqa: BLE001
        out["layer_fp8"] = f"ERROR {e!r}\n{traceback.format_exc()}"[-1500:]
    for k, v in out.items():
        log(f"  fp8 check {k}: {v}")
    return out


def stage_timings(params, x_TD, dims: Dims, device, log):
    """The FP8 path's own stages, and the 2d x 2d FP8 grouped GEMM a weight gradient would need (16-aligned groups)."""
    from moe_launch.kernels import fp8, gather, swiglu
    from moe_launch.kernels.index_gen import route_indices
    from moe_launch.kernels.moe import _Fp8Gemms

    router_ED, wg, wu, wd = params
    w_TK, idx_TK = route(x_TD, router_ED, dims.K)
    plan = route_indices(idx_TK, 0, dims.E)
    mm = _Fp8Gemms(plan, "torch")
    xq_ND, xs_N = mm.gathered_rows(x_TD)
    bg = fp8.quantize_operand(wg.transpose(1, 2))
    g_NF = fp8.scaled_grouped_mm(xq_ND, xs_N, *bg, plan)
    h_NF = swiglu.swiglu_fwd(g_NF, g_NF, plan.num_rows)
    N, E, D, Fh = xq_ND.shape[0], dims.E, dims.D, dims.F
    ends = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (N // E)  # equal 16-aligned groups
    aT = torch.randn(D, N, device=device).to(torch.float8_e4m3fn)  # dy^T, row-major (K = tokens contiguous)
    bT = torch.randn(Fh, N, device=device).to(torch.float8_e4m3fn).t()  # h, column-major
    sa, sb = torch.rand(E * D, device=device) + 0.5, torch.rand(E * Fh, device=device) + 0.5
    wgrad = lambda: torch._scaled_grouped_mm(aT, bT, sa, sb, offs=ends, out_dtype=torch.bfloat16)
    stages = {
        "fp8 quantize x_TD (T rows)": lambda: fp8.quantize_rows(x_TD),
        "fp8 gathered rows x_ND (quantize + gather + scales)": lambda: mm.gathered_rows(x_TD),
        "fp8 quantize w_gate, fwd channels (rows)": lambda: fp8.quantize_operand(wg.transpose(1, 2)),
        "fp8 quantize w_gate, dgrad channels (strided)": lambda: fp8.quantize_operand(wg),
        "fp8 quantize w_down, dgrad channels (strided)": lambda: fp8.quantize_operand(wd),
        "fp8 quantize h_NF (N rows of F)": lambda: fp8.quantize_rows(h_NF, plan.num_rows),
        "fp8 gmm gate (scaled_grouped_mm)": lambda: fp8.scaled_grouped_mm(xq_ND, xs_N, *bg, plan),
        "variant: fp8 gmm gate, use_fast_accum=True": lambda: torch._scaled_grouped_mm(
            xq_ND, bg[0], xs_N, bg[1], offs=plan.ends_E, out_dtype=torch.bfloat16, use_fast_accum=True),
        "bf16 gathered rows x_ND (for the wgrad)": lambda: gather.gather_rows(x_TD, plan.row_token_N, plan.num_rows),
        "variant: fp8 wgrad 2d x 2d, equal groups": wgrad,
    }
    res = {}
    for name, fn in stages.items():
        try:
            res[name] = bench(fn, device, rep_ms=200)
        except Exception as e:  # noqa: BLE001
            res[name] = float("nan")
            log(f"  stage {name} failed: {e!r}"[:400])
        log(f"  stage {name:52s} {res[name]:8.3f} ms")
    try:  # is the 2d x 2d result the per-group product, scales group-major?
        c = wgrad().float()
        a_, b_ = aT.float(), bT.float()
        lo = 0
        ref = []
        for e in range(E):
            hi = int(ends[e])
            ref.append((a_[:, lo:hi] * 1) @ b_[lo:hi] * sa[e * D:(e + 1) * D, None] * sb[None, e * Fh:(e + 1) * Fh])
            lo = hi
        res["variant: fp8 wgrad 2d x 2d rel err vs fp32"] = rel(c, torch.stack(ref))
        log(f"  fp8 wgrad 2d x 2d vs fp32 per-group product: {res['variant: fp8 wgrad 2d x 2d rel err vs fp32']:.1e}")
    except Exception as e:  # noqa: BLE001
        log(f"  fp8 wgrad 2d x 2d check failed: {e!r}"[:400])
    return res


def profiled(step, iters: int):
    """torch.profiler's record of `iters` calls of step() queued back to back, after one warm-up call."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return prof


def kernel_breakdown(step, log, iters: int = 5, label: str = "FP8", top: int = 14) -> dict:
    """CUDA time per kernel name over `iters` calls of step() (torch.profiler), largest first, per call."""
    prof = profiled(step, iters)
    rows = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)
        if us > 0:
            # names are cut to 90 characters: instantiations of one template add up under their common prefix
            ms, n = rows.get(ev.key[:90], (0.0, 0))
            rows[ev.key[:90]] = (ms + us / iters / 1e3, n + ev.count // iters)
    rows = dict(sorted(rows.items(), key=lambda kv: -kv[1][0]))
    log(f"  kernels of one {label} fwd+bwd (ms per call, launches): total {sum(v[0] for v in rows.values()):.2f} ms")
    for name, (ms, n) in list(rows.items())[:top]:
        log(f"    {ms:7.3f} ms  x{n:<3d} {name}")
    device_gaps(prof, iters, log)
    return rows


def device_gaps(prof, iters: int, log, top: int = 6) -> None:
    """Where the device waited between the profiled calls' kernels (queued back to back, no sync between calls): the
    span from the first kernel's start to the last one's end per call, its idle share, and the longest gaps with the
    kernels on either side. The first call is left out: the profiler's start delays its launches."""
    kernels = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda ev: ev.time_range.start)
    kernels = kernels[len(kernels) // iters:]
    calls = iters - 1
    if len(kernels) < 2 or calls < 1:
        return
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    gaps, end, prev = [], kernels[0].time_range.end, kernels[0]
    for ev in kernels[1:]:
        if ev.time_range.start > end:
            gaps.append((ev.time_range.start - end, prev.name[:40], ev.name[:40]))
        if ev.time_range.end >= end:
            end, prev = ev.time_range.end, ev
    idle = sum(g for g, _, _ in gaps)
    log(f"  device span per call {span / calls / 1e3:.3f} ms, idle {idle / calls / 1e3:.3f} ms between kernels "
        f"(calls 2..{iters}); longest gaps (us, after -> before):")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        log(f"    {g:8.1f}  {a} -> {b}")
