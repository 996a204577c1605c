"""Would FP8 pay for the dense layers? The attention projections and the output head of OLMoE-1B-7B, each GEMM of one
micro-batch timed in bf16 and as an e4m3 torch._scaled_mm with the expert path's recipe (activations scaled per row,
weights per output channel, fp32 accumulation, bf16 out), with what FP8 adds: quantizing the activation operand of
each GEMM (kernels/fp8.py quantize_rows, our Triton kernel) in every call, and the weight in both orientations once
per optimizer step.

Run on one GPU:  PYTHONUNBUFFERED=1 python benchmarks/fp8_dense.py --out $OUT
CPU smoke run:   TRITON_INTERPRET=1 python benchmarks/fp8_dense.py --smoke --out /tmp/fp8_dense   (tiny shapes; the
                 FP8 GEMM is emulated in fp32 there, so its times mean nothing: it checks the script)
Per linear layer (x_TK @ w_MK^T, T tokens): forward y = x w^T and input gradient dx = dy w run in FP8 (as the experts'
forward and activation-gradient GEMMs do); the weight gradient dw = dy^T x stays bf16 in both rows. Saved per call =
(bf16 forward + input gradient) - (FP8 forward + input gradient + quantizing x and dy). Median ms, do_bench.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass

import torch
from moe_layer import bench, file_log


@dataclass
class Linear:
    name: str
    K: int  # input features
    M: int  # output features
    per_step: int  # calls per micro-batch in the full model


def linears(smoke: bool) -> tuple[int, list[Linear]]:
    """Tokens per micro-batch and the dense linears of OLMoE-1B-7B (16 layers: q, k, v, o of d 2048; head to the
    padded vocabulary 50304)."""
    if smoke:
        return 64, [Linear("attention projection (q, k, v, o)", 32, 32, 64), Linear("output head", 32, 96, 1)]
    return 8192, [Linear("attention projection (q, k, v, o)", 2048, 2048, 64),
                  Linear("output head", 2048, 50304, 1)]


def scaled_mm(aq_TK, as_T, bq_KM, bs_M, emulate: bool) -> torch.Tensor:
    """(as * aq) @ (bq * bs) in bf16: torch._scaled_mm on sm90, an fp32 emulation elsewhere."""
    if emulate:
        return ((aq_TK.float() * as_T[:, None]) @ (bq_KM.float() * bs_M[None, :])).to(torch.bfloat16)
    return torch._scaled_mm(aq_TK, bq_KM, scale_a=as_T[:, None], scale_b=bs_M[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=False)


def operand(b_KM: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The b operand of torch._scaled_mm from a weight view: e4m3 column-major [K, M], one scale per column m (the
    grouped GEMM's operand with one group)."""
    from moe_launch.kernels import fp8

    q_1KM, s_1M = fp8.quantize_operand(b_KM[None])
    return q_1KM[0], s_1M[0]


def measure(lin: Linear, T: int, device, emulate: bool, rep_ms: int) -> dict:
    from moe_launch.kernels import fp8

    dt = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    x_TK = torch.randn(T, lin.K, generator=g).to(device, dt)
    dy_TM = torch.randn(T, lin.M, generator=g).to(device, dt)
    w_MK = (torch.randn(lin.M, lin.K, generator=g) * 0.02).to(device, dt)
    xq, xs = fp8.quantize_rows(x_TK)
    dyq, dys = fp8.quantize_rows(dy_TM)
    wq_fwd, ws_fwd = operand(w_MK.t())  # y = x @ w^T: b [K, M], a scale per output column m
    wq_bwd, ws_bwd = operand(w_MK)  # dx = dy @ w: b [M, K], a scale per k (strided reads of w)
    err = {"y": (scaled_mm(xq, xs, wq_fwd, ws_fwd, emulate).float() - (x_TK @ w_MK.t()).float()).norm().item()
           / (x_TK @ w_MK.t()).float().norm().item()}
    t = {
        "bf16 forward": bench(lambda: x_TK @ w_MK.t(), device, rep_ms),
        "bf16 input gradient": bench(lambda: dy_TM @ w_MK, device, rep_ms),
        "bf16 weight gradient": bench(lambda: dy_TM.t() @ x_TK, device, rep_ms),
        "fp8 forward": bench(lambda: scaled_mm(xq, xs, wq_fwd, ws_fwd, emulate), device, rep_ms),
        "fp8 input gradient": bench(lambda: scaled_mm(dyq, dys, wq_bwd, ws_bwd, emulate), device, rep_ms),
        "quantize x": bench(lambda: fp8.quantize_rows(x_TK), device, rep_ms),
        "quantize dy": bench(lambda: fp8.quantize_rows(dy_TM), device, rep_ms),
        "quantize w, both orientations (once per step)": bench(
            lambda: (operand(w_MK.t()), operand(w_MK)), device, rep_ms),
    }
    saved = (t["bf16 forward"] + t["bf16 input gradient"]
             - t["fp8 forward"] - t["fp8 input gradient"] - t["quantize x"] - t["quantize dy"])
    return {"linear": asdict(lin), "T": T, "ms": t, "saved_ms_per_call": saved,
            "saved_ms_per_micro_batch": saved * lin.per_step,
            "weights_ms_per_step": t["quantize w, both orientations (once per step)"] * lin.per_step,
            "rel_err_y": err["y"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of the script's own logic (FP8 emulated)")
    ap.add_argument("--rep-ms", type=int, default=300)
    args = ap.parse_args()
    from moe_launch.kernels.fp8 import fp8_gemm_supported

    log = file_log(args.out, "fp8_dense.log")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    emulate = not fp8_gemm_supported(device)
    if emulate and not args.smoke:
        raise SystemExit("no sm90 GPU: torch._scaled_mm with row-wise scales needs one (use --smoke on CPU)")
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "fp8_emulated": emulate}
    log(json.dumps(env))
    T, lins = linears(args.smoke)
    rows = [measure(lin, T, device, emulate, args.rep_ms) for lin in lins]
    log(f"T = {T} tokens per micro-batch; median ms per call")
    log("| linear | K, M | calls per micro-batch | " + " | ".join(rows[0]["ms"]) + " | FP8 saves per call | "
        "per micro-batch | weights, per step | rel err of y |")
    log("|---" * (len(rows[0]["ms"]) + 7) + "|")
    for r in rows:
        lin = r["linear"]
        log(f"| {lin['name']} | {lin['K']}, {lin['M']} | {lin['per_step']} | "
            + " | ".join(f"{v:.3f}" for v in r["ms"].values())
            + f" | {r['saved_ms_per_call']:.3f} | {r['saved_ms_per_micro_batch']:.2f} | "
              f"{r['weights_ms_per_step']:.2f} | {r['rel_err_y']:.1e} |")
    total = sum(r["saved_ms_per_micro_batch"] for r in rows)
    weights = sum(r["weights_ms_per_step"] for r in rows)
    log(f"FP8 for every dense linear: saves {total:.2f} ms per micro-batch, costs {weights:.2f} ms per step "
        "(the weights)")
    with open(os.path.join(args.out, "fp8_dense.json"), "w") as f:
        json.dump({"env": env, "rows": rows, "saved_ms_per_micro_batch": total, "weights_ms_per_step": weights}, f,
                  indent=1)


if __name__ == "__main__":
    main()
