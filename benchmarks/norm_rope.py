"""QK-norm + RoPE, forward and backward: the fused kernel (kernels/norm_rope.py) against the model's modules compiled
by Inductor (what `train.compile` runs without model.qk_norm_rope_fusion), alone and inside the compiled attention
sublayer.

Run on one GPU:  PYTHONUNBUFFERED=1 python benchmarks/norm_rope.py --out $OUT
`--smoke` runs a tiny fp32 version on the CPU (Triton interpreted, eager in place of Inductor) to check the script.

Rows, at OLMoE-1B-7B's attention (d 2048, 16 heads of 128, bf16, 4 x 4096 tokens by default):
  norm+rope    one projection's norm and rotation, forward + backward to x and the norm's weight: the kernel vs the
               compiled modules; the bytes a single pass must move (read x and g, write y and dx) over GPU time;
  attention    the attention sublayer (q/k/v/o projections, QK-norm, RoPE, SDPA) compiled as compile_model does, with
               and without the fusion, forward + backward.
Median ms of triton.testing.do_bench (wall time of the call, host overhead included), and the GPU's kernel time per
call from the profiler (what the call costs inside a training step, where the host runs ahead of the GPU); outputs
and gradients of the kernel compared with the compiled modules'. The table printed last is the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from cross_entropy import bench, rel_err
from moe_layer_fp8 import profiled

from moe_launch.conf import presets
from moe_launch.conf.schema import ModelConfig
from moe_launch.kernels.norm_rope import norm_rope
from moe_launch.trainer.dtypes import cast_parameters
from moe_launch.trainer.model.attention import Attention
from moe_launch.trainer.model.norm import RMSNorm
from moe_launch.trainer.model.rope import Rotary


def fwd_bwd(fn, x, params, g):
    def run():
        for p in params:
            p.grad = None
        xi = x.detach().requires_grad_()
        y = fn(xi)
        y.backward(g)
        return y.detach(), xi.grad, *[p.grad for p in params]
    return run


def kernel_ms(fn, device, calls: int = 20) -> float | None:
    """GPU time per call: the sum of the kernels' durations the profiler records (None on the CPU)."""
    if device.type != "cuda":
        return None
    return sum(e.self_device_time_total for e in profiled(fn, calls).key_averages()) / calls / 1e3


def norm_rope_rows(cfg: ModelConfig, B: int, S: int, device, dtype, compile_: bool) -> list[dict]:
    D, Dh = cfg.d_model, cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    x_BSD = torch.randn(B, S, D, generator=gen).to(device, dtype)
    g_BSD = torch.randn(B, S, D, generator=gen).to(device, dtype)
    rotary = Rotary(Dh, S, cfg.rope_theta).to(device)
    norm = RMSNorm(D, cfg.norm_eps).to(device, dtype)
    cos, sin = rotary.cos_SDh[:S], rotary.sin_signed_SDh[:S]

    def modules(x_BSD):
        y_BHSDh = rotary(norm(x_BSD).view(B, S, D // Dh, Dh).transpose(1, 2))
        return y_BHSDh.transpose(1, 2).reshape(B, S, D)

    ref = fwd_bwd(torch.compile(modules) if compile_ else modules, x_BSD, [norm.weight], g_BSD)
    fused = fwd_bwd(lambda x: norm_rope(x, norm.weight, norm.eps, cos, sin), x_BSD, [norm.weight], g_BSD)
    want, got = ref(), fused()
    errs = {n: rel_err(a, b) for n, a, b in zip(("y", "dx", "dw"), got, want)}
    moved = 4 * x_BSD.numel() * x_BSD.element_size()  # one pass: read x, write y; read x and g, write dx
    rows = []
    for name, fn in (("norm+rope compiled modules", ref), ("norm+rope fused kernel", fused)):
        ms = bench(fn, device)
        gpu = kernel_ms(fn, device)
        rows.append({"case": name, "ms": ms, "gpu ms": gpu, "GB/s one pass": moved / (gpu or ms) / 1e6,
                     "rel err vs modules": errs if "fused" in name else None})
    return rows


def attention_rows(cfg: ModelConfig, B: int, S: int, device, dtype, compile_: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    x_BSD = (torch.randn(B, S, cfg.d_model, generator=gen) * 0.5).to(device, dtype)
    g_BSD = torch.randn(B, S, cfg.d_model, generator=gen).to(device, dtype)
    rows, outs = [], {}
    for fusion in (False, True):
        c = ModelConfig(**{**cfg.__dict__, "qk_norm_rope_fusion": fusion})
        torch.manual_seed(2)
        attn = Attention(c, Rotary(c.head_dim, S, c.rope_theta)).to(device)
        cast_parameters(attn, dtype)  # as the trainer does: the rotary tables stay fp32
        if compile_:
            attn.compile()
        run = fwd_bwd(attn, x_BSD, list(attn.parameters()), g_BSD)
        outs[fusion] = run()
        rows.append({"case": f"attention sublayer, fusion {'on' if fusion else 'off'}", "ms": bench(run, device),
                     "gpu ms": kernel_ms(run, device)})
    errs = [rel_err(a, b) for a, b in zip(outs[True], outs[False])]
    rows[1]["rel err vs modules"] = {"y": errs[0], "dx": errs[1], "worst dw": max(errs[2:])}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run that checks the script")
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    cfg = presets.MODELS["olmoe_1b7b"]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, S = args.batch, args.seq
    if args.smoke:
        cfg = ModelConfig(name="smoke", d_model=64, n_heads=4, max_seq_len=32)
        B, S = 2, 32
    compile_ = device.type == "cuda"
    rows = norm_rope_rows(cfg, B, S, device, dtype, compile_) + attention_rows(cfg, B, S, device, dtype, compile_)
    meta = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "shape": f"{B}x{S} tokens, d {cfg.d_model}, {cfg.n_heads} heads", "dtype": str(dtype)}
    if device.type == "cuda":
        import triton
        meta["triton"] = triton.__version__
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "norm_rope.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(json.dumps(meta))
    print(f"{'case':<36} {'ms':>8} {'gpu ms':>8} {'GB/s one pass':>14}  rel err vs modules")
    for r in rows:
        gbs = f"{r['GB/s one pass']:.0f}" if "GB/s one pass" in r else ""
        gpu = f"{r['gpu ms']:.3f}" if r["gpu ms"] is not None else "-"
        err = r.get("rel err vs modules")
        err_s = ", ".join(f"{k} {v:.1e}" for k, v in err.items()) if err else ""
        print(f"{r['case']:<36} {r['ms']:>8.3f} {gpu:>8} {gbs:>14}  {err_s}")


if __name__ == "__main__":
    main()
