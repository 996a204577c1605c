"""The SwiGLU kernels between the grouped GEMMs (kernels/swiglu.py) per tile: rows per program and warps.

Run on one GPU:  PYTHONUNBUFFERED=1 python benchmarks/swiglu_tiles.py --out $OUT
For each layer shape (N = T*K rows of the expert hidden size F, all valid, routing weights and pairs as the layer's
backward hands them), four kernels:
  fwd        h = silu(g) * u                                       (bf16 layer, unfused path)
  fwd fp8    h's e4m3 rows and scales, h never written             (FP8 layer)
  bwd        dg, du, w*h and the routing weight's gradient         (bf16 layer)
  bwd fp8    the same plus the e4m3 rows of [dg du]                (FP8 layer)
Every candidate tile's outputs are first compared with the default tile's (the element-wise outputs bit for bit; the
routing weight's gradient, a row sum whose order the tile may change, to 1e-5), then timed (do_bench median with
the L2 flushed, ms). GB/s counts each byte read or written once; a device-to-device copy of the same bytes, timed in
the same run, is the ceiling it is compared with. Prints one line per kernel, shape and tile, a table last.
`--layer` then times the layer (benchmarks/moe_shapes.py's rows bf16 and FP8 with weights reused, OLMoE dims at 16k
tokens and 128 experts of F 768) with the default tiles and with each kernel's fastest tile from the sweep, alternating
twice in the same process, every run checked against the naive pipeline first.
`--smoke` runs a tiny fp32 version on the CPU (Triton's interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

from moe_launch.kernels import swiglu
from moe_launch.kernels.swiglu import KERNELS, RowTile, row_tile, swiglu_bwd_triton, swiglu_fwd_fp8, swiglu_fwd_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer import file_log  # noqa: E402


def shapes(smoke: bool) -> dict[str, tuple[int, int, int]]:
    """name -> (tokens T, top-k K, expert hidden F)."""
    if smoke:
        return {"tiny": (24, 2, 32)}
    return {"OLMoE 16k": (16384, 8, 1024), "OLMoE 8k": (8192, 8, 1024), "fine 128, F 768": (16384, 8, 768),
            "very fine 256, F 512": (16384, 8, 512)}


def candidates(F: int, smoke: bool, kind: str) -> list[RowTile]:
    """The default tile first, then rows per program x warps over whole-row column blocks (the FP8 variants need
    whole rows; the bf16 ones are timed on the same tiles)."""
    default = row_tile(F, not smoke, kind)
    if smoke:
        return [default, RowTile(2, default.cols, 4)]
    # 8 rows of 1,024 at 4 warps already spill registers (ptxas); more rows per program only cut the programs
    tiles = [RowTile(r, default.cols, w) for r in (1, 2, 4, 8) for w in (4, 8, 16)
             if (r, w) != (8, 4) and r * default.cols >= 32 * w]
    return [default] + [t for t in tiles if t != default]


def run_kernel(kind: str, g, u, dh, num_rows, routing, tile: RowTile) -> tuple[torch.Tensor, ...]:
    if kind == "fwd":
        return (swiglu_fwd_triton(g, u, num_rows, tile=tile),)
    if kind == "fwd fp8":
        return swiglu_fwd_fp8(g, u, num_rows, tile=tile)
    return swiglu_bwd_triton(g, u, dh, num_rows, quant=kind == "bwd fp8", routing=routing, tile=tile)


def bytes_moved(kind: str, N: int, F: int, P: int, el: int) -> int:
    """Bytes each kernel reads and writes once: g, u (and dh) in; h, or e4m3 codes and scales, or dg, du, w*h (and
    [dg du] in e4m3 with scales) out; the backward also reads w and the row's pair and writes the weight's gradient,
    which the call zeroes first."""
    if kind == "fwd":
        return 3 * N * F * el
    if kind == "fwd fp8":
        return 2 * N * F * el + N * F + 4 * N
    moved = 6 * N * F * el + N * (4 + 4) + P * 4 * 2
    return moved + (2 * N * F + 4 * N if kind == "bwd fp8" else 0)


def same(outs, ref) -> float:
    """0.0 where every element-wise output equals the default tile's bit for bit (dw, the fourth backward output, to
    1e-5 relative); else the largest relative difference."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(outs, ref)):
        a, b = a.float(), b.float()
        if i == 3 and len(outs) > 2:  # dw_TK: a row sum
            d = float((a - b).norm() / b.norm().clamp_min(1e-30))
            worst = max(worst, d if d > 1e-5 else 0.0)
        elif not torch.equal(a, b):
            worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-30)) or 1e-30)
    return worst


def measure(T: int, K: int, F: int, smoke: bool, log) -> dict:
    dev = torch.device("cpu" if smoke else "cuda")
    dt = torch.float32 if smoke else torch.bfloat16
    N = P = T * K  # every pair served by one row
    gen = torch.Generator(device=dev).manual_seed(0)
    g, u, dh = (torch.randn(N, F, device=dev, dtype=dt, generator=gen) for _ in range(3))
    w_TK = torch.rand(T, K, device=dev, dtype=torch.float32, generator=gen)
    row_pair_N = torch.randperm(N, device=dev, generator=gen).to(torch.int32)
    num_rows = torch.tensor([N], device=dev, dtype=torch.int32)
    out = {"T": T, "K": K, "F": F, "N": N, "rows": []}
    if not smoke:
        import triton.testing
        src = torch.empty(3 * N * F * g.element_size() // 2, dtype=torch.int16, device=dev)
        dst = torch.empty_like(src)
        copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=100)
        out["copy_GBps"] = 2 * src.numel() * 2 / copy_ms / 1e6
        log(f"copy of {2 * src.numel() * 2 / 2**20:.0f} MiB read+write: {copy_ms:.3f} ms = {out['copy_GBps']:.0f} GB/s")
        del src, dst
    for kind in KERNELS:
        if smoke and "fp8" in kind:
            continue  # the e4m3 rows need the GPU's cast; tests/kernels checks them on the CPU against quantize_rows
        routing = (w_TK, row_pair_N) if kind.startswith("bwd") else None
        tiles = candidates(F, smoke, kind)
        ref = run_kernel(kind, g, u, dh, num_rows, routing, tiles[0])
        for t in tiles:
            outs = run_kernel(kind, g, u, dh, num_rows, routing, t)
            diff = same(outs, ref)
            row = {"kernel": kind, "rows": t.rows, "cols": t.cols, "warps": t.warps, "default": t == tiles[0],
                   "diff": diff}
            if diff:
                log(f"{kind} {t}: differs from the default tile by {diff:.2e}; not timed")
                out["rows"].append(row)
                continue
            if not smoke:
                import triton.testing
                ms = triton.testing.do_bench(lambda k=kind, r=routing, t=t: run_kernel(k, g, u, dh, num_rows, r, t),
                                             rep=100)
                row["ms"] = ms
                row["GBps"] = bytes_moved(kind, N, F, P, g.element_size()) / ms / 1e6
                log(f"{kind:8s} rows {t.rows:2d} cols {t.cols:4d} warps {t.warps:2d}: {ms:.3f} ms "
                    f"{row['GBps']:.0f} GB/s{'  (default)' if row['default'] else ''}")
            out["rows"].append(row)
    return out


def table(results: dict, log) -> None:
    log("\n| shape | kernel | default tile: ms (GB/s) | best tile | best: ms (GB/s) | speed-up | copy GB/s |")
    log("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for kind in KERNELS:
            rows = [x for x in r["rows"] if x["kernel"] == kind and "ms" in x]
            if not rows:
                continue
            d = next(x for x in rows if x["default"])
            b = min(rows, key=lambda x: x["ms"])
            log(f"| {name} | {kind} | {d['ms']:.3f} ({d['GBps']:.0f}) | {b['rows']} rows x {b['cols']}, "
                f"{b['warps']} warps | {b['ms']:.3f} ({b['GBps']:.0f}) | {d['ms'] / b['ms']:.2f}x | "
                f"{r.get('copy_GBps', 0):.0f} |")


def best_tiles(results: dict) -> dict[tuple[str, int], RowTile]:
    """(kernel, column block) -> the tile timed fastest at the most rows (the largest shape of that column block)."""
    best: dict[tuple[str, int], tuple[int, RowTile]] = {}
    for r in results.values():
        for kind in KERNELS:
            rows = [x for x in r["rows"] if x["kernel"] == kind and "ms" in x]
            if rows:
                b = min(rows, key=lambda x: x["ms"])
                key = (kind, b["cols"])
                if key not in best or r["N"] > best[key][0]:
                    best[key] = (r["N"], RowTile(b["rows"], b["cols"], b["warps"]))
    return {k: t for k, (_, t) in best.items()}


@contextlib.contextmanager
def tiles_in_use(best: dict[tuple[str, int], RowTile] | None):
    """The layer's SwiGLU launches take these tiles (None: the defaults) while inside."""
    default = swiglu.row_tile

    def chosen(Fdim: int, cuda: bool, kernel: str) -> RowTile:
        t = default(Fdim, cuda, kernel)
        return best.get((kernel, t.cols), t) if best else t

    swiglu.row_tile = chosen
    try:
        yield
    finally:
        swiglu.row_tile = default


def layer_ab(best: dict[tuple[str, int], RowTile], log) -> list[dict]:
    import moe_shapes as ms

    runs = []
    for shape in (ms.Shape("OLMoE dims, 16k tokens", ms.Dims(T=16384, D=2048, F=1024, E=64, K=8)),
                  ms.Shape("fine: 128 experts, F 768", ms.Dims(T=16384, D=2048, F=768, E=128, K=8))):
        for rnd in range(2):
            for label, tiles in (("default", None), ("best", best)):
                with tiles_in_use(tiles):
                    res = ms.run_shape(shape, torch.device("cuda"), torch.bfloat16, True, 300, log,
                                       rows=["bf16", "fp8-reused"])
                for row in ("bf16", "fp8-reused"):
                    r = res["rows"][ms.ROW_KEYS[row]]
                    runs.append({"shape": shape.name, "round": rnd, "tiles": label, "row": row, "ms": r.get("ms"),
                                 "ok": r.get("ok"), "err": r.get("error")})
    log("\n| shape | row | default tiles ms (run 1, run 2) | fastest tiles ms (run 1, run 2) | change of the means |")
    log("|---|---|---|---|---|")
    for shape in dict.fromkeys(r["shape"] for r in runs):
        for row in ("bf16", "fp8-reused"):
            sel = [r for r in runs if r["shape"] == shape and r["row"] == row]
            if any(r["ms"] is None or not r["ok"] for r in sel):
                log(f"| {shape} | {row} | failed: {[(r['tiles'], r['ok'], r['err']) for r in sel]} | | |")
                continue
            d = [r["ms"] for r in sel if r["tiles"] == "default"]
            b = [r["ms"] for r in sel if r["tiles"] == "best"]
            log(f"| {shape} | {row} | {d[0]:.3f}, {d[1]:.3f} | {b[0]:.3f}, {b[1]:.3f} | "
                f"{100 * (sum(b) / sum(d) - 1):+.1f}% |")
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layer", action="store_true", help="then the layer with the default and the fastest tiles")
    ap.add_argument("--only", default="", help="comma-separated substrings: sweep the shapes whose name has one")
    args = ap.parse_args()
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    log = file_log(args.out, f"swiglu_tiles-{stamp}.log")
    meta = {"torch": torch.__version__, "gpu": None if args.smoke else torch.cuda.get_device_name(),
            "utc": stamp}
    log(json.dumps(meta))
    results = {name: measure(T, K, F, args.smoke, log) for name, (T, K, F) in shapes(args.smoke).items()
               if not wanted or any(w in name for w in wanted)}
    out = {"meta": meta, "results": results}
    if not args.smoke:
        table(results, log)
        best = best_tiles(results)
        out["best"] = {f"{k} / {c}": vars(t) for (k, c), t in best.items()}
        log("fastest tiles: " + json.dumps(out["best"]))
        if args.layer:
            out["layer"] = layer_ab(best, log)
    else:
        bad = [(n, x) for n, r in results.items() for x in r["rows"] if x["diff"]]
        if bad:
            raise SystemExit(f"tiles disagree with the default tile: {bad}")
    with open(os.path.join(args.out, f"swiglu_tiles-{stamp}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
