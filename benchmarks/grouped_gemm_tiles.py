"""Our persistent TMA grouped GEMM (kernels/grouped_gemm_tma.py) against torch's CUTLASS grouped GEMMs, per tile.

Run on one GPU (sm90):  PYTHONUNBUFFERED=1 python benchmarks/grouped_gemm_tiles.py --out $OUT
For each GEMM the expert layer runs (rows spread evenly over the experts, weights stored as the layer stores them):
  torch bf16   torch._grouped_mm                          (what the bf16 layer runs)
  torch fp8    kernels.fp8.scaled_grouped_mm_torch        (what the FP8 layer runs: rows presented, fp32 promotion)
  ours         grouped_mm_persistent, for every tile in TILES (bf16 and e4m3 operands)
Each of ours is first checked against torch's result on the same operands (relative L2; fresh random data), then
timed (do_bench median). Prints one line per GEMM with the best tile of each dtype, and a table last.
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
from moe_launch.kernels.grouped_gemm_tma import Tiles, grouped_mm_persistent

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer import SPEC_TFLOPS, file_log  # noqa: E402

BF16_TILES = [Tiles(128, 256, 64, 8, 3), Tiles(128, 256, 64, 8, 3, group_m=8), Tiles(128, 256, 64, 8, 4, group_m=8),
              Tiles(256, 128, 64, 8, 3, group_m=8), Tiles(128, 256, 64, 8, 3, flatten=True),
              Tiles(128, 256, 64, 8, 3, group_m=8, flatten=True)]
FP8_TILES = [Tiles(256, 128, 128, 8, 3), Tiles(256, 128, 128, 8, 3, group_m=8), Tiles(256, 128, 128, 8, 4, group_m=8),
             Tiles(128, 256, 128, 8, 3, group_m=8), Tiles(256, 128, 128, 8, 3, group_m=8, flatten=True)]


def gemms() -> dict[str, tuple[int, int, int, int, bool]]:
    """name -> (rows N, K, M, experts E, b K-major). K-major b: x @ w^T with w stored [E, M, K] (forward GEMMs and
    every FP8 operand); not K-major: dy @ w with w stored [E, K, M] (the bf16 activation gradients)."""
    return {"OLMoE fwd gate": (131072, 2048, 1024, 64, True), "OLMoE fwd gate+up": (131072, 2048, 2048, 64, True),
            "OLMoE fwd down": (131072, 1024, 2048, 64, True), "OLMoE bwd dh": (131072, 2048, 1024, 64, False),
            "OLMoE bwd dx gate": (131072, 1024, 2048, 64, False),
            "OLMoE 8k fwd down": (65536, 1024, 2048, 64, True),
            "fine 128 fwd gate+up": (131072, 2048, 1536, 128, True),
            "coarse 8 fwd gate+up": (16384, 4096, 28672, 8, True), "coarse 8 bwd dh": (16384, 4096, 14336, 8, False),
            "gpt-oss fwd gate+up": (65536, 2880, 5760, 32, True),
            # 512-1024 rows per expert with model dims or expert sizes past 2048
            "Phi-like fwd gate": (16384, 4096, 6400, 16, True), "Phi-like fwd down": (16384, 6400, 4096, 16, True),
            "Phi-like bwd dx gate": (16384, 6400, 4096, 16, False),
            "Scout-like fwd gate": (8192, 5120, 8192, 16, True), "Scout-like fwd down": (8192, 8192, 5120, 16, True),
            "Kimi-K2 EP8 fwd gate": (32736, 7168, 2048, 48, True),
            "Kimi-K2 EP8 fwd down": (32736, 2048, 7168, 48, True),
            "Kimi-K2 EP8 bwd dh": (32736, 7168, 2048, 48, False),
            "Qwen2-57B fwd gate": (65536, 3584, 2560, 64, True), "Qwen2-57B fwd down": (65536, 2560, 3584, 64, True)}


def rel(x: torch.Tensor, ref: torch.Tensor, rows: int) -> float:
    x, ref = x[:rows].float(), ref[:rows].float()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def measure(N: int, K: int, M: int, E: int, kmajor: bool, rep_ms: int, log) -> dict:
    dev = torch.device("cuda")
    counts_E = torch.full((E,), N // E, device=dev, dtype=torch.int32)
    offsets_E1 = torch.zeros(E + 1, device=dev, dtype=torch.int32)
    offsets_E1[1:] = torch.cumsum(counts_E, 0)
    ends_E = offsets_E1[1:]
    a_NK = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(E, M, K, device=dev) * 0.02).to(torch.bfloat16)
    b_EKM = w.transpose(1, 2) if kmajor else w.reshape(E, K, M)
    aq, as_ = fp8.quantize_rows(a_NK)
    bq, bs = fp8.quantize_operand(b_EKM)  # always K-major (kernels/fp8_weights.py's layout)
    ref_bf16 = torch._grouped_mm(a_NK, b_EKM, offs=ends_E)
    ref_fp8 = fp8.scaled_grouped_mm_torch(aq, as_, bq, bs, ends_E)
    row = {"torch bf16": triton.testing.do_bench(lambda: torch._grouped_mm(a_NK, b_EKM, offs=ends_E), warmup=25,
                                                 rep=rep_ms, return_mode="median"),
           "torch fp8": triton.testing.do_bench(lambda: fp8.scaled_grouped_mm_torch(aq, as_, bq, bs, ends_E,
                                                                                    compact=False),
                                                warmup=25, rep=rep_ms, return_mode="median"),
           "ours bf16": {}, "ours fp8": {}, "errors": {}}
    for kind, tiles, args, ref in (("bf16", BF16_TILES, (a_NK, b_EKM, counts_E, offsets_E1), ref_bf16),
                                   ("fp8", FP8_TILES, (aq, bq, counts_E, offsets_E1, as_, bs), ref_fp8)):
        for t in tiles:
            name = f"{t.BM}x{t.BN}x{t.BK} w{t.num_warps} s{t.num_stages} g{t.group_m}" + (" flat" if t.flatten else "")
            try:
                out = grouped_mm_persistent(*args, tiles=t)
                err = rel(out, ref, N)
                row["errors"][f"{kind} {name}"] = err
                if not err < (1e-2 if kind == "bf16" else 2e-2):
                    log(f"    {kind} {name}: WRONG, rel err {err:.2e}")
                    continue
                row[f"ours {kind}"][name] = triton.testing.do_bench(
                    lambda args=args, t=t: grouped_mm_persistent(*args, tiles=t), warmup=25, rep=rep_ms,
                    return_mode="median")
            except Exception as e:  # a tile that does not compile (shared memory, an unsupported option)
                log(f"    {kind} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--only", default="", help="comma-separated substrings of the GEMM names to run")
    args = ap.parse_args()
    only = [o for o in args.only.split(",") if o]
    log = file_log(args.out, "grouped_gemm_tiles.log")
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}
    rows = []

    log(json.dumps(env))
    torch.manual_seed(0)
    table = ["| GEMM | N, K, M, E | torch bf16 ms (TFLOP/s) | ours bf16, best tile | torch fp8 (promoted) | "
             "ours fp8, best tile |", "|---|---|---|---|---|---|"]
    for gname, (N, K, M, E, kmajor) in gemms().items():
        if only and not any(o in gname for o in only):
            continue
        row = {"gemm": gname, "N": N, "K": K, "M": M, "E": E, "b_kmajor": kmajor,
               **measure(N, K, M, E, kmajor, args.rep_ms, log)}
        rows.append(row)
        flops = 2 * N * K * M

        def fmt(ms: float | None, flops: int = flops) -> str:
            return "–" if ms is None else f"{ms:.3f} ({flops / ms / 1e9:.0f})"

        best = {k: min(row[f"ours {k}"].items(), key=lambda kv: kv[1]) if row[f"ours {k}"] else ("none", None)
                for k in ("bf16", "fp8")}
        log(f"{gname}: " + json.dumps({k: row[k] for k in ("torch bf16", "torch fp8", "ours bf16", "ours fp8")}))
        table.append(f"| {gname} | {N}, {K}, {M}, {E} | {fmt(row['torch bf16'])} | {fmt(best['bf16'][1])} "
                     f"{best['bf16'][0]} | {fmt(row['torch fp8'])} | {fmt(best['fp8'][1])} {best['fp8'][0]} |")
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "grouped_gemm_tiles.json"), "w") as f:
        json.dump({"env": env, "spec": SPEC_TFLOPS, "rows": rows}, f, indent=1)
    log("\n".join(table))


if __name__ == "__main__":
    main()
