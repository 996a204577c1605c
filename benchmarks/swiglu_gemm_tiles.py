"""The fused SwiGLU grouped GEMMs (kernels/swiglu_gemm.py) against the unfused stages they replace, per tile.

Run on one GPU (sm90):  PYTHONUNBUFFERED=1 python benchmarks/swiglu_gemm_tiles.py --out $OUT
For each layer shape (rows spread evenly over the experts, weights stored as the layer stores them), two stages:
  up      CUTLASS gate GEMM + CUTLASS up GEMM + the SwiGLU kernel     against swiglu_up
  dx      CUTLASS dx gate + dx up GEMMs + combining two row sets      against dual_mm + combining one
Each fused result is first checked against the unfused one on the same operands (relative L2), then timed
(do_bench median, ms). Prints one line per stage and shape, a table last.
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

from moe_launch.kernels import swiglu_gemm as sg
from moe_launch.kernels.grouped_gemm_tma import Tiles
from moe_launch.kernels.reduce import combine
from moe_launch.kernels.swiglu import swiglu_bwd, swiglu_fwd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer import file_log  # noqa: E402

UP_TILES = [Tiles(128, 128, 64, 8, 3, group_m=8), Tiles(128, 128, 64, 8, 4, group_m=8)]
DUAL_TILES = [Tiles(128, 128, 64, 8, 3, group_m=8), Tiles(128, 256, 32, 8, 3, group_m=8),
              Tiles(128, 256, 32, 8, 4, group_m=8), Tiles(128, 256, 64, 8, 2, group_m=8)]


def shapes() -> dict[str, tuple[int, int, int, int, int]]:
    """name -> (tokens T, top-k, model dim D, expert hidden F, experts E)."""
    return {"OLMoE 16k": (16384, 8, 2048, 1024, 64), "OLMoE 8k": (8192, 8, 2048, 1024, 64),
            "fine 128": (16384, 8, 2048, 768, 128), "very fine 256": (16384, 8, 2048, 512, 256),
            "coarse 8": (8192, 2, 4096, 14336, 8), "gpt-oss-20b": (16384, 4, 2880, 2880, 32)}


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def name(t: Tiles) -> str:
    return f"{t.BM}x{t.BN}x{t.BK} w{t.num_warps} s{t.num_stages} g{t.group_m}" + (" flat" if t.flatten else "")


def measure(T: int, K: int, D: int, F: int, E: int, rep_ms: int, log) -> dict:
    dev = torch.device("cuda")
    N = T * K
    counts_E = torch.full((E,), N // E, device=dev, dtype=torch.int32)
    offsets_E1 = torch.zeros(E + 1, device=dev, dtype=torch.int32)
    offsets_E1[1:] = torch.cumsum(counts_E, 0)
    ends_E, num_rows = offsets_E1[1:], offsets_E1[-1:]
    pair_row_TK = torch.randperm(N, device=dev, dtype=torch.int32).reshape(T, K)  # each row one (token, k) pair
    x_ND, dy_ND = (torch.randn(N, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    w_gate, w_up = ((0.02 * torch.randn(E, F, D, device=dev)).bfloat16() for _ in range(2))
    w_down = (0.02 * torch.randn(E, D, F, device=dev)).bfloat16()
    gm = torch._grouped_mm

    def up_unfused():
        g = gm(x_ND, w_gate.transpose(1, 2), offs=ends_E)
        u = gm(x_ND, w_up.transpose(1, 2), offs=ends_E)
        return g, u, swiglu_fwd(g, u, num_rows)

    g_NF, u_NF, _ = up_unfused()

    dg_NF, du_NF, _ = swiglu_bwd(g_NF, u_NF, gm(dy_ND, w_down, offs=ends_E), num_rows)

    def dx_unfused():
        return combine(gm(dg_NF, w_gate, offs=ends_E), pair_row_TK, None, rows2_ND=gm(du_NF, w_up, offs=ends_E))

    stages = {
        "up": (up_unfused, UP_TILES, lambda t: sg.swiglu_up(x_ND, w_gate.transpose(1, 2), w_up.transpose(1, 2),
                                                            counts_E, offsets_E1, tiles=t)),
        "dx": (dx_unfused, DUAL_TILES, lambda t: combine(sg.dual_mm(dg_NF, w_gate, du_NF, w_up, counts_E,
                                                                    offsets_E1, tiles=t), pair_row_TK, None)),
    }
    row = {}
    for stage, (unfused, tiles, fused) in stages.items():
        ref = unfused()
        ref = ref if isinstance(ref, tuple) else (ref,)
        out = {"unfused": triton.testing.do_bench(unfused, warmup=25, rep=rep_ms, return_mode="median"), "fused": {},
               "errors": {}}
        for t in tiles:
            try:
                got = fused(t)
                got = got if isinstance(got, tuple) else (got,)
                err = max(rel(a, b) for a, b in zip(got, ref))
                out["errors"][name(t)] = err
                if not err < 2e-2:
                    log(f"    {stage} {name(t)}: WRONG, rel err {err:.2e}")
                    continue
                out["fused"][name(t)] = triton.testing.do_bench(lambda t=t, fused=fused: fused(t), warmup=25,
                                                                rep=rep_ms, return_mode="median")
            except Exception as e:  # a tile that does not compile (shared memory, registers)
                log(f"    {stage} {name(t)}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        row[stage] = out
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--only", default="", help="comma-separated substrings of the shape names")
    args = ap.parse_args()
    log = file_log(args.out, "swiglu_gemm_tiles.log")
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}

    log(json.dumps(env))
    torch.manual_seed(0)
    rows = []
    table = ["| shape | T, top-k, D, F, E | stage | unfused ms | fused ms, best tile | speed-up |",
             "|---|---|---|---|---|---|"]
    only = [s for s in args.only.split(",") if s]
    for sname, (T, K, D, F, E) in shapes().items():
        if only and not any(s in sname for s in only):
            continue
        row = measure(T, K, D, F, E, args.rep_ms, log)
        rows.append({"shape": sname, "T": T, "K": K, "D": D, "F": F, "E": E, **row})
        for stage, out in row.items():
            log(f"{sname} {stage}: " + json.dumps({k: out[k] for k in ("unfused", "fused")}))
            if out["fused"]:
                best, ms = min(out["fused"].items(), key=lambda kv: kv[1])
                table.append(f"| {sname} | {T}, {K}, {D}, {F}, {E} | {stage} | {out['unfused']:.3f} | {ms:.3f} "
                             f"{best} | {out['unfused'] / ms:.2f}× |")
            else:
                table.append(f"| {sname} | {T}, {K}, {D}, {F}, {E} | {stage} | {out['unfused']:.3f} | – | – |")
    with open(os.path.join(args.out, "swiglu_gemm_tiles.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    log("\n".join(table))


if __name__ == "__main__":
    main()
