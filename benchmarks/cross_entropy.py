"""The output head + cross-entropy, forward and backward: the trainer's chunked head with the fused softmax kernel,
the same with torch's passes, the fused kernel at the torch path's shorter chunk, and F.cross_entropy over the whole
batch's logits (what HF and an unchunked trainer run).

Run on one GPU:  PYTHONUNBUFFERED=1 python benchmarks/cross_entropy.py --out $OUT
`--smoke` runs a tiny fp32 version on the CPU to check the script itself.

For each token count at OLMoE-1B-7B's head (d 2048, vocabulary 50304, bf16) it times loss + backward to h and W,
median ms of do_bench, and reports the three GEMMs' rate (6·T·d·V FLOPs), the time past those GEMMs alone (a
chunk's three GEMMs timed by themselves, times the chunks) and the peak memory above the inputs. Loss, dh and dW of
each variant are compared with the torch chunked path. The table printed last is the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from moe_launch.trainer.model.loss import chunk_tokens, chunked_cross_entropy, logit_bytes


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def bench(fn, device) -> float:
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def variants(h_TD, w_VD, y_T):
    def chunked(fused, chunk=None):
        def run():
            h, w = h_TD.detach().requires_grad_(), w_VD.detach().requires_grad_()
            loss = chunked_cross_entropy(h, w, y_T, chunk=chunk, fused=fused)
            loss.backward()
            return loss.detach(), h.grad, w.grad
        return run

    def full_logits():
        h, w = h_TD.detach().requires_grad_(), w_VD.detach().requires_grad_()
        loss = F.cross_entropy((h @ w.t()).float(), y_T)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    torch_chunk = chunk_tokens(w_VD.shape[0], logit_bytes(w_VD.dtype, fused=False))
    return {"chunked, fused kernel": chunked(True), "chunked, torch passes": chunked(False),
            # the kernel alone, without the longer chunk its smaller buffers allow
            "chunked, fused kernel, torch's chunk": chunked(True, torch_chunk),
            "F.cross_entropy, full logits": full_logits}


def gemms_only(h_TD, w_VD, device) -> float:
    """The three GEMMs of all chunks alone, as the fused chunked head runs them (bf16 logits, dh and dW with fp32
    out)."""
    C = min(chunk_tokens(w_VD.shape[0], logit_bytes(w_VD.dtype, fused=device.type == "cuda")), h_TD.shape[0])
    h_CD = h_TD[:C].contiguous()
    dw_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=device)
    fp32_out = device.type == "cuda"

    def run():
        g_CV = h_CD @ w_VD.t()
        if fp32_out:
            torch.mm(g_CV, w_VD, out_dtype=torch.float32)
            torch.addmm(dw_VD, g_CV.t(), h_CD, out_dtype=torch.float32, out=dw_VD)
        else:
            g_CV @ w_VD
            dw_VD.add_(g_CV.t() @ h_CD)
    return bench(run, device) * h_TD.shape[0] / C


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    D, V = (64, 512) if args.smoke else (2048, 50304)
    token_counts = (256,) if args.smoke else (8192, 16384, 65536)
    rows = []
    for T in token_counts:
        gen = torch.Generator(device=device).manual_seed(0)
        h_TD = torch.randn(T, D, device=device, generator=gen).to(dtype)
        w_VD = (torch.randn(V, D, device=device, generator=gen) * D ** -0.5).to(dtype)
        y_T = torch.randint(0, V, (T,), device=device, generator=gen)
        runs = variants(h_TD, w_VD, y_T)
        want = runs["chunked, torch passes"]()
        gemm_ms = gemms_only(h_TD, w_VD, device)
        for name, fn in runs.items():
            if name.startswith("F.cross_entropy") and T > 16384:
                continue  # its fp32 logits alone take 13 GiB at 64k tokens
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            got = fn()
            ms = bench(fn, device)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else 0.0
            errs = [rel_err(g, w) for g, w in zip(got, want)]
            row = {"tokens": T, "variant": name, "ms": round(ms, 3), "gemm_ms": round(gemm_ms, 3),
                   "past_gemms_ms": round(ms - gemm_ms, 3), "tflops": 6 * T * D * V / ms / 1e9,
                   "peak_gib": round(peak, 2), "rel_err_loss": errs[0], "rel_err_dh": errs[1], "rel_err_dw": errs[2]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "d": D, "vocab": V,
            "chunk_fused": chunk_tokens(V, logit_bytes(dtype, True)),
            "chunk_torch": chunk_tokens(V, logit_bytes(dtype, False))}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cross_entropy.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"\n{meta}\n{'tokens':>6s} {'variant':36s} {'ms':>8s} {'TFLOP/s':>8s} {'GEMMs ms':>8s} {'past GEMMs':>10s} "
          f"{'GiB':>6s} {'err loss':>8s} {'err dh':>8s} {'err dW':>8s}")
    for r in rows:
        print(f"{r['tokens']:6d} {r['variant']:36s} {r['ms']:8.2f} {r['tflops']:8.0f} {r['gemm_ms']:8.2f} "
              f"{r['past_gemms_ms']:10.2f} {r['peak_gib']:6.2f} {r['rel_err_loss']:8.1e} {r['rel_err_dh']:8.1e} "
              f"{r['rel_err_dw']:8.1e}")


if __name__ == "__main__":
    main()
