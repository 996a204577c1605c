"""The grouped GEMMs on operands whose rows start mid cache line, against the same values in rows that start at line
boundaries (kernels/_launch.row_buffer's pitch).

Run on one GPU (sm90):  PYTHONUNBUFFERED=1 python benchmarks/row_pitch.py --out $OUT
`--smoke` runs a tiny version on the CPU (Triton interpreter) to check the script itself.

For each shape (rows routed by a real top-k over random logits) it times, median ms of do_bench, with the A operands
(x rows, and dg / du rows) first contiguous, then copied into kernels/_launch.row_buffer's rows:
  swiglu_up          the fused gate + up GEMM with the SwiGLU epilogue (kernels/swiglu_gemm.py)
  dual_mm            dg @ w_gate + du @ w_up in one accumulator
  wgrad dg^T x       our weight-gradient GEMM adding into a gradient buffer (kernels/grouped_gemm.py)
  cutlass x @ wg^T   torch._grouped_mm on the same rows
and checks that the fused kernels give the same values on both layouts, bit for bit. The table printed last is the
summary. At dims that fill whole lines the two layouts are the same tensors: those rows show the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton.testing

from moe_launch.kernels import swiglu_gemm as sg
from moe_launch.kernels._launch import row_buffer
from moe_launch.kernels.grouped_gemm import grouped_mm_wgrad_triton
from moe_launch.kernels.index_gen import route_indices


def shapes(smoke: bool) -> dict[str, tuple[int, int, int, int, int]]:  # T, D, F, E, K
    if smoke:
        return {"tiny": (64, 40, 24, 4, 2)}
    return {"model dim 1000, F 2000": (8192, 1000, 2000, 32, 8),
            "the same at 1024, 2048 (lines filled)": (8192, 1024, 2048, 32, 8),
            "model dim 2000, F 1000": (12000, 2000, 1000, 60, 4)}


def line_rows(t: torch.Tensor) -> torch.Tensor:
    out = row_buffer(t.shape[0], t.shape[1], t.dtype, t.device)
    out.copy_(t)
    return out


def measure(T: int, D: int, F: int, E: int, K: int, smoke: bool) -> dict:
    dev = torch.device("cpu" if smoke else "cuda")
    dt = torch.bfloat16  # the fused kernels take 16-bit operands (the interpreter too)
    gen = torch.Generator(device=dev).manual_seed(0)
    idx_TK = torch.randn(T, E, device=dev, generator=gen).topk(K, dim=1).indices.to(torch.int32)
    p = route_indices(idx_TK, 0, E)
    N = T * K
    x_ND = torch.randn(N, D, device=dev, generator=gen).to(dt)
    wg_EFD, wu_EFD = ((torch.randn(E, F, D, device=dev, generator=gen) * 0.02).to(dt) for _ in range(2))
    dg_NF, du_NF = (torch.randn(N, F, device=dev, generator=gen).to(dt) for _ in range(2))
    grad_EFD = torch.zeros(E, F, D, device=dev, dtype=dt)
    calls = {
        "swiglu_up": lambda x, a1, a2: sg.swiglu_up(x, wg_EFD.transpose(1, 2), wu_EFD.transpose(1, 2), p.counts_E,
                                                    p.offsets_E1)[2],
        "dual_mm": lambda x, a1, a2: sg.dual_mm(a1, wg_EFD, a2, wu_EFD, p.counts_E, p.offsets_E1),
        "wgrad dg^T x": lambda x, a1, a2: grouped_mm_wgrad_triton(a1, x, p.offsets_E1, out_EMK=grad_EFD),
    }
    if not smoke:
        calls["cutlass x @ wg^T"] = lambda x, a1, a2: torch._grouped_mm(x, wg_EFD.transpose(1, 2), offs=p.ends_E)
    layouts = {"contiguous": (x_ND, dg_NF, du_NF), "line-aligned": tuple(map(line_rows, (x_ND, dg_NF, du_NF)))}
    res = {"ms": {}, "same": {}}
    for name, fn in calls.items():
        outs = {}
        for lname, ops in layouts.items():
            outs[lname] = fn(*ops).clone()
            if not smoke:
                res["ms"].setdefault(name, {})[lname] = triton.testing.do_bench(lambda fn=fn, ops=ops: fn(*ops))
        if name in ("swiglu_up", "dual_mm"):
            R = int(p.num_rows)
            res["same"][name] = bool(torch.equal(outs["contiguous"][:R], outs["line-aligned"][:R]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0],
            "gpu": None if args.smoke else torch.cuda.get_device_name()}
    print(json.dumps(meta), flush=True)
    results = {name: measure(*dims, args.smoke) for name, dims in shapes(args.smoke).items()}
    with open(os.path.join(args.out, f"row_pitch-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    different = [(s, k) for s, r in results.items() for k, same in r["same"].items() if not same]
    if different:
        raise SystemExit(f"the two layouts gave different values: {different}")
    if args.smoke:
        return
    print("\n| shape | T, D, F, E, top-k | kernel | contiguous ms | line-aligned ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for sname, r in results.items():
        dims = ", ".join(map(str, shapes(False)[sname]))
        for k, ms in r["ms"].items():
            print(f"| {sname} | {dims} | {k} | {ms['contiguous']:.3f} | {ms['line-aligned']:.3f}"
                  f" | {ms['contiguous'] / ms['line-aligned']:.2f}x |")


if __name__ == "__main__":
    main()
