"""Expert weight gradients added into a gradient buffer: torch's grouped GEMM + an add, against our Triton kernel
that adds in its epilogue.

Run on one GPU (sm90):  PYTHONUNBUFFERED=1 python benchmarks/wgrad_accumulate.py --out $OUT
`--smoke` runs a tiny fp32 version on the CPU (Triton interpreter) to check the script itself; `--only` picks shapes
by name (comma-separated substrings).

With gradient accumulation every micro-batch's expert weight gradients land in the flat bf16 gradient buffer. torch's
grouped GEMM writes a new tensor, which autograd then adds to the buffer (reading both, writing one): three passes
over the gradient per micro-batch. `kernels.grouped_gemm.grouped_mm_wgrad_triton(..., out_EMK=grad)` reads the old
gradient in the GEMM's epilogue instead. For each shape (rows routed by a real top-k over random logits) and each of
the two weight-gradient GEMM orientations it times, median ms of do_bench:
  torch           torch._grouped_mm(a^T, b) alone (what the layer runs now)
  torch + add     the same, then grad.add_(c) (what a micro-batch costs now)
  triton <tile>   our kernel accumulating into grad, for each tile in TILES
and checks every Triton result against torch's (relative L2 ≤ 1e-2). The table printed last is the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton.testing

from moe_launch.kernels.grouped_gemm import WgradTiles, grouped_mm_wgrad_reference, grouped_mm_wgrad_triton, wgrad_tiles
from moe_launch.kernels.index_gen import route_indices

TILES = {  # name -> tile; "tma": rows read through TMA descriptors that end at the expert's last row. The layer
    # runs grouped_gemm.wgrad_tiles (the first TMA one)
    "tma 128x256x64 w8 s3": WgradTiles(128, 256, 64, 8, 3, tma=True),
    "tma 128x256x64 w8 s4": WgradTiles(128, 256, 64, 8, 4, tma=True),
    "tma 256x128x64 w8 s3": WgradTiles(256, 128, 64, 8, 3, tma=True),
    "tma 128x256x32 w8 s5": WgradTiles(128, 256, 32, 8, 5, tma=True),
    "tma 128x128x64 w4 s3": WgradTiles(128, 128, 64, 4, 3, tma=True),
    "128x256x64 w8 s3": WgradTiles(128, 256, 64, 8, 3),
}


def shapes(smoke: bool) -> dict[str, tuple[int, int, int, int, int]]:  # T, D, F, E, K
    if smoke:
        return {"tiny": (64, 32, 16, 4, 2)}
    return {"OLMoE, trainer micro-batch 8k tokens": (8192, 2048, 1024, 64, 8),
            "OLMoE, 16k tokens": (16384, 2048, 1024, 64, 8),
            "fine, 128 experts": (16384, 2048, 768, 128, 8),
            "coarse, 8 experts": (8192, 4096, 14336, 8, 2),
            # fewer rows per expert: where the kernel's per-tile prologue and epilogue weigh most
            "Granite-like, 4k tokens (819 rows per expert)": (4096, 1536, 512, 40, 8),
            "very fine, 256 experts (512 rows per expert)": (16384, 2048, 512, 256, 8),
            "OLMoE, 4k tokens (512 rows per expert)": (4096, 2048, 1024, 64, 8),
            "dims 2000 x 1000 (400 rows per expert)": (6000, 2000, 1000, 60, 4),
            "OLMoE, 2k tokens (256 rows per expert)": (2048, 2048, 1024, 64, 8)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def measure(T: int, D: int, F: int, E: int, K: int, smoke: bool, log) -> list[dict]:
    dev = torch.device("cpu" if smoke else "cuda")
    dt = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    idx_TK = torch.randn(T, E, device=dev, generator=gen).topk(K, dim=1).indices.to(torch.int32)
    plan = route_indices(idx_TK, 0, E)
    N = T * K
    rows = []
    for name, M, Kc in (("gate/up: dg^T x", F, D), ("down: dy^T h", D, F)):
        a_NM = torch.randn(N, M, device=dev, generator=gen).to(dt)
        b_NK = torch.randn(N, Kc, device=dev, generator=gen).to(dt)
        grad0 = (torch.randn(E, M, Kc, device=dev, generator=gen) * 0.1).to(dt)
        flops = 2.0 * N * M * Kc
        if smoke:
            want = grad0.float() + grouped_mm_wgrad_reference(a_NM.float(), b_NK.float(), plan.offsets_E1)
        else:
            want = grad0.float() + torch._grouped_mm(a_NM.t(), b_NK, offs=plan.ends_E).float()
        row = {"gemm": name, "M": M, "K": Kc, "N": N, "ms": {}, "err": {}}
        if not smoke:
            grad = grad0.clone()
            row["ms"]["torch"] = triton.testing.do_bench(
                lambda a=a_NM, b=b_NK: torch._grouped_mm(a.t(), b, offs=plan.ends_E))
            row["ms"]["torch + add"] = triton.testing.do_bench(
                lambda a=a_NM, b=b_NK, g=grad: g.add_(torch._grouped_mm(a.t(), b, offs=plan.ends_E)))
        tiles = {"cpu": wgrad_tiles(M, Kc, False, False)} if smoke else TILES
        for tname, tile in tiles.items():
            grad = grad0.clone()
            try:
                grouped_mm_wgrad_triton(a_NM, b_NK, plan.offsets_E1, out_EMK=grad, tiles=tile)
            except Exception as exc:  # a tile this GPU cannot run (shared memory, registers) is reported, not fatal
                row["err"][tname] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
                continue
            row["err"][tname] = rel_err(grad, want)
            if not smoke:
                row["ms"][tname] = triton.testing.do_bench(
                    lambda a=a_NM, b=b_NK, g=grad, t=tile: grouped_mm_wgrad_triton(a, b, plan.offsets_E1, out_EMK=g,
                                                                                  tiles=t))
        if not smoke:
            for tname in ("tma 128x256x64 w8 s3", "tma 256x128x64 w8 s3"):
                row["ms"][f"{tname}, no add"] = triton.testing.do_bench(
                    lambda a=a_NM, b=b_NK, t=TILES[tname]: grouped_mm_wgrad_triton(a, b, plan.offsets_E1, tiles=t))
        row["tflops"] = {k: flops / (v * 1e-3) / 1e12 for k, v in row["ms"].items()}
        log(f"  {name} M {M} K {Kc}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items()))
        log("    errors: " + ", ".join(f"{k} {v if isinstance(v, str) else f'{v:.1e}'}" for k, v in row["err"].items()))
        bad = [k for k, v in row["err"].items() if not isinstance(v, str) and v > 1e-2]
        if bad:
            raise SystemExit(f"wrong result from {bad} at {name}")
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated substrings: run the shapes whose name has one")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())

    def log(msg: str) -> None:
        print(msg, flush=True)

    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0],
            "gpu": None if args.smoke else torch.cuda.get_device_name()}
    log(json.dumps(meta))
    results = {}
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    for sname, (T, D, F, E, K) in shapes(args.smoke).items():
        if wanted and not any(w in sname for w in wanted):
            continue
        log(f"{sname}: T {T}, D {D}, F {F}, E {E}, top-{K}")
        results[sname] = measure(T, D, F, E, K, args.smoke, log)
    with open(os.path.join(args.out, f"wgrad_accumulate-{stamp}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    if args.smoke:
        return
    layer = "tma 128x256x64 w8 s3"  # the tile grouped_gemm.wgrad_tiles gives the layer
    assert TILES[layer] == wgrad_tiles(1024, 2048, True, True)
    log("\n| shape | GEMM (M, K) | torch | torch + add | the layer's tile, accumulating | layer / (torch + add) |"
        " best triton, accumulating | tile | best / (torch + add) |")
    log("|---|---|---|---|---|---|---|---|---|")
    for sname, rows in results.items():
        for r in rows:
            tri = {k: v for k, v in r["ms"].items() if k not in ("torch", "torch + add") and "no add" not in k}
            best = min(tri, key=tri.get)
            add = r["ms"]["torch + add"]
            log(f"| {sname} | {r['gemm']} ({r['M']}, {r['K']}) | {r['ms']['torch']:.3f} | {add:.3f}"
                f" | {tri[layer]:.3f} | {tri[layer] / add:.2f}"
                f" | {tri[best]:.3f} ({r['tflops'][best]:.0f} TFLOP/s) | {best} | {tri[best] / add:.2f} |")


if __name__ == "__main__":
    main()
