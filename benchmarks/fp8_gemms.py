"""The expert layer's grouped GEMMs one by one, FP8 against bf16, at the shapes of benchmarks/moe_shapes.py.

Run on one GPU (sm90):  PYTHONUNBUFFERED=1 python benchmarks/fp8_gemms.py --out $OUT
For every shape and each of the four GEMMs the FP8 path runs (forward gate+up as one, forward down, backward dh,
backward dx over [dg du]) it times, on uniformly routed rows (T*K/E per expert):
  bf16       torch._grouped_mm on the bf16 operands (for gate+up and dx: one GEMM, as the FP8 path shapes them)
  fp8        torch._scaled_grouped_mm, row-wise scales, use_fast_accum=False (fp32 promotion: what the layer runs)
  fp8 fast   the same with use_fast_accum=True (the tensor cores' own accumulator; not used by the layer)
  fp8 presented (, compact)  kernels.fp8.scaled_grouped_mm_torch: fp32 promotion, with more rows handed to torch
             where that selects its large tiles (kernels.fp8.rows_to_present), the result a view (copied back)
and the time to quantize the activation rows and the weight operand (kernels/fp8.py). Median ms (do_bench) and
TFLOP/s; the kernel each call ran (the CUTLASS template's tile shape) is logged for the FP8 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.testing

from moe_launch.kernels import fp8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer import SPEC_TFLOPS  # noqa: E402


def shapes() -> dict[str, tuple[int, int, int, int, int]]:  # T, D, F, E, K
    return {"OLMoE-1B-7B": (16384, 2048, 1024, 64, 8), "fine 128": (16384, 2048, 768, 128, 8),
            "very fine 256": (16384, 2048, 512, 256, 8), "coarse 8": (8192, 4096, 14336, 8, 2),
            "OLMoE T 8192": (8192, 2048, 1024, 64, 8), "OLMoE T 4096": (4096, 2048, 1024, 64, 8)}


def gemms(D: int, F: int) -> dict[str, tuple[int, int]]:  # name -> (K, M) of a_NK @ b_EKM
    return {"fwd gate+up": (D, 2 * F), "fwd down": (F, D), "bwd dh": (D, F), "bwd dx": (2 * F, D)}


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({ev.key for ev in prof.key_averages() if "cutlass" in ev.key or "gemm" in ev.key.lower()})


def measure(T: int, E: int, K: int, Kd: int, M: int, rep_ms: int) -> dict:
    """Median ms of every way to run one a [T*K, Kd] @ b [E, Kd, M] GEMM, rows spread evenly over the E groups."""
    dev = torch.device("cuda")
    N = T * K
    ends_E = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (N // E)
    torch.manual_seed(0)
    a_NK = torch.randn(N, Kd, device=dev, dtype=torch.bfloat16)
    b_EKM = (torch.randn(E, M, Kd, device=dev) * 0.02).to(torch.bfloat16).transpose(1, 2)  # stored as weights are
    aq, as_ = fp8.quantize_rows(a_NK)
    bq, bs = fp8.quantize_operand(b_EKM)
    fns = {
        "bf16": lambda: torch._grouped_mm(a_NK, b_EKM, offs=ends_E, out_dtype=torch.bfloat16),
        "fp8": lambda: torch._scaled_grouped_mm(aq, bq, as_, bs, offs=ends_E, out_dtype=torch.bfloat16,
                                                use_fast_accum=False),
        "fp8 fast": lambda: torch._scaled_grouped_mm(aq, bq, as_, bs, offs=ends_E, out_dtype=torch.bfloat16,
                                                     use_fast_accum=True),
        "fp8 presented": lambda: fp8.scaled_grouped_mm_torch(aq, as_, bq, bs, ends_E, compact=False),
        "fp8 presented, compact": lambda: fp8.scaled_grouped_mm_torch(aq, as_, bq, bs, ends_E),
        "quant a": lambda: fp8.quantize_rows(a_NK),
        "quant b": lambda: fp8.quantize_operand(b_EKM),
    }
    row = {name: triton.testing.do_bench(fn, warmup=50, rep=rep_ms, return_mode="median") for name, fn in fns.items()}
    row["fp8_kernel"] = [k[-120:] for k in kernel_names(fns["fp8"])]
    row["rows_presented"] = fp8.rows_to_present(N, E, Kd, M)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rep-ms", type=int, default=200)
    args = ap.parse_args()
    log_path = os.path.join(args.out, "fp8_gemms.log")
    results = {"env": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                       "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}, "rows": []}

    def log(msg: str) -> None:
        print(msg, flush=True)
        with open(log_path, "a") as f:
            f.write(msg + "\n")

    def rate(ms: float, spec: float) -> str:
        return f"{ms:.3f} ms ({flops / ms / 1e9:.0f}, {flops / ms / 1e9 / spec:.0%} of spec)"

    log(json.dumps(results["env"]))
    log(f"TFLOP/s in parentheses, and the share of the spec peak (bf16 {SPEC_TFLOPS['bf16']:.0f}, "
        f"FP8 {SPEC_TFLOPS['fp8']:.0f} TFLOP/s)")
    for sname, (T, D, F, E, K) in shapes().items():
        for gname, (Kd, M) in gemms(D, F).items():
            row = {"shape": sname, "gemm": gname, "N": T * K, "K": Kd, "M": M, "E": E,
                   **measure(T, E, K, Kd, M, args.rep_ms)}
            flops = 2 * T * K * Kd * M
            results["rows"].append(row)
            bf16, f8 = SPEC_TFLOPS["bf16"], SPEC_TFLOPS["fp8"]
            log(f"{sname:14s} {gname:12s} N {T * K:6d} K {Kd:5d} M {M:5d} | bf16 {rate(row['bf16'], bf16)} | fp8 "
                f"{rate(row['fp8'], f8)} | fp8 fast {rate(row['fp8 fast'], f8)} | presented {row['rows_presented']} "
                f"rows: {rate(row['fp8 presented'], f8)}, compact {rate(row['fp8 presented, compact'], f8)} | quant a "
                f"{row['quant a']:.3f} b {row['quant b']:.3f}")
            log(f"    fp8 kernel: {row['fp8_kernel']}")
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "fp8_gemms.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
