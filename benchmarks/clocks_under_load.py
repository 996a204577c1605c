"""The GPU's SM clock and power while it runs the dense matmul and the MoE layer, the way the benchmarks time them.

Run on one GPU:  python benchmarks/clocks_under_load.py --out $OUT
The layer benchmarks time with triton's do_bench: the L2 cache cleared before every call, about a second of calls per
row. Whether those calls run at the boost clock or at the clock the power cap leaves decides what "the dense rate"
and a layer's time are. nvidia-smi samples clocks and power every 100 ms in the background while each phase runs:
idle; the 8192^3 bf16 matmul for a few seconds; the OLMoE layer (16k tokens) back to back, then with the L2 cleared
between calls; a short burst of layer calls after the GPU has rested. The table gives per phase the time per call,
the mean SM clock and power, and the clock-event reasons nvidia-smi reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer import Dims, make_layer  # noqa: E402

QUERY = "timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active"
REASONS = {0x1: "idle", 0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal",
           0x80: "hw power brake"}


def sampler(path: str) -> subprocess.Popen:
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                            stdout=open(path, "w"), stderr=subprocess.DEVNULL)


def read_samples(path: str) -> list[tuple[float, float, float, float, float, int]]:
    """-> (unix seconds, SM MHz, watts, power limit W, temperature C, event-reason bits) per sample line."""
    out = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            ts += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            out.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]), int(parts[5], 16)))
        except ValueError:
            continue
    return out


def summarize(samples, t0: float, t1: float) -> dict:
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if not inside:
        return {"samples": 0}
    bits = 0
    for s in inside:
        bits |= s[5]
    return {"samples": len(inside), "sm_mhz": sum(s[1] for s in inside) / len(inside),
            "sm_mhz_min": min(s[1] for s in inside), "watts": sum(s[2] for s in inside) / len(inside),
            "power_limit": inside[0][3], "temp_max": max(s[4] for s in inside),
            "reasons": ", ".join(n for b, n in REASONS.items() if bits & b) or "none"}


def timed_phase(fn, seconds: float, flush: torch.Tensor | None = None) -> tuple[float, float, float]:
    """Run fn for about `seconds`; -> (median ms per call between events, wall start, wall end)."""
    times, t0 = [], time.time()
    while time.time() - t0 < seconds:
        evs = []
        for _ in range(8):  # 8 calls queued per host sync keep the device busy
            if flush is not None:
                flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            evs.append((a, b))
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) for a, b in evs]
    times.sort()
    return times[len(times) // 2], t0, time.time()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each loaded phase")
    args = ap.parse_args()
    from moe_launch.kernels.moe import fast_experts

    dev = torch.device("cuda")
    d = Dims()
    torch.manual_seed(0)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    x_TD = torch.randn(d.T, d.D, device=dev, dtype=torch.bfloat16)
    dy_TD = torch.randn_like(x_TD)
    params = [(torch.randn(*s, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
              for s in ((d.E, d.D), (d.E, d.F, d.D), (d.E, d.F, d.D), (d.E, d.D, d.F))]
    layer = make_layer(fast_experts, params, d.K)
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)  # as triton's do_bench clears the L2

    def layer_step():
        for p in params:
            p.grad = None
        layer(x_TD.detach().requires_grad_()).backward(dy_TD)

    for _ in range(3):
        layer_step()
        a @ a
    torch.cuda.synchronize()
    path = os.path.join(args.out or tempfile.mkdtemp(), "clocks_under_load.csv")
    proc = sampler(path)
    phases = []
    try:
        time.sleep(3.0)
        t = time.time()
        time.sleep(3.0)
        phases.append(("idle", None, t, time.time()))
        ms, t0, t1 = timed_phase(lambda: a @ a, args.seconds)
        dense = f"{ms:.3f} ms = {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s"
        phases.append(("dense bf16 8192^3, back to back", dense, t0, t1))
        flops = 3 * 2 * d.D * d.F * d.T * d.K * 3
        ms, t0, t1 = timed_phase(layer_step, args.seconds)
        phases.append(("MoE layer 16k, back to back", f"{ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", t0, t1))
        ms, t0, t1 = timed_phase(layer_step, args.seconds, flush=flush)
        phases.append(("MoE layer 16k, L2 cleared per call", f"{ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", t0, t1))
        time.sleep(8.0)
        ms, t0, t1 = timed_phase(layer_step, 0.15)
        phases.append(("MoE layer 16k, burst after 8 s idle", f"{ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", t0, t1))
        ms, t0, t1 = timed_phase(lambda: a @ a, 0.15)
        phases.append(("dense bf16 8192^3, burst", f"{ms:.3f} ms = {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s", t0, t1))
        time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait()
    samples = read_samples(path)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {len(samples)} nvidia-smi samples")
    print("| phase | time per call | SM MHz mean (min) | W mean / limit | max °C | clock-event reasons |")
    print("|---|---|---|---|---|---|")
    for name, result, t0, t1 in phases:
        s = summarize(samples, t0, t1)
        rows.append({"phase": name, "result": result, **s})
        if s["samples"]:
            print(f"| {name} | {result or '-'} | {s['sm_mhz']:.0f} ({s['sm_mhz_min']:.0f}) | {s['watts']:.0f} / "
                  f"{s['power_limit']:.0f} | {s['temp_max']:.0f} | {s['reasons']} |")
        else:
            print(f"| {name} | {result or '-'} | no samples | | | |")
    if args.out:
        with open(os.path.join(args.out, "clocks_under_load.json"), "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(), "phases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
