"""GPU health benchmark: the preflight compute check and the all-to-all, on real devices.

    python benchmarks/health_gpu.py                                   # compute check on GPU 0 (1xH200)
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/health_gpu.py --expect-busbw 338.0 --json a2a.json
                                                                      # + all-to-all over 2 GPUs (NCCL)
    python benchmarks/health_gpu.py --cpu                             # tiny CPU mode (what CI can run)
    torchrun --nproc-per-node 2 benchmarks/health_gpu.py --cpu        # tiny all-to-all with gloo

Runs exactly the code preflight runs (moe_launch.health.gpu_check / alltoall), prints tables in the nccl-tests
layout, and with --json writes the numbers for benchmarks/RESULTS.md. All-to-all sizes default to 1 MiB .. 8 GiB per
rank on GPU (x16 steps, like our recorded 2xH200 baseline), 1 KiB .. 1 MiB on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moe_launch.health.alltoall import format_table, measure_size, size_ladder
from moe_launch.health.baselines import judge_alltoall
from moe_launch.health.gpu_check import compute_check


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny mode on CPU (gloo)")
    p.add_argument("--iters", type=int, default=0, help="all-to-all iterations per size (default 20 GPU, 3 CPU)")
    p.add_argument("--max-bytes", type=int, default=0, help="largest all-to-all size per rank")
    p.add_argument("--gemm-size", type=int, default=0, help="GEMM M=N=K (default 8192 GPU, 256 CPU)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--expect-busbw", type=float, default=0.0,
                   help="a recorded busbw (GB/s) at the largest size: judged as preflight does (>= 0.9x, 0 wrong)")
    return p.parse_args()


def _compute_table(out) -> str:
    return "\n".join([
        f"{'device':<24} {'dtype':>8} {'size':>6} {'TFLOP/s':>9} {'max rel err':>12} {'checksum err':>13} "
        f"{'mem filled GiB':>15} {'ok':>4}",
        f"{out.device_name:<24} {out.dtype:>8} {out.size:>6} {out.tflops:>9.4g} {out.max_rel_err:>12.2e} "
        f"{out.checksum_rel_err:>13.2e} {out.mem_gib:>15.1f} {'yes' if out.ok else 'NO':>4}",
    ] + [f"  reason: {r}" for r in out.reasons])


def main() -> int:
    a = _args()
    on_gpu = not a.cpu and torch.cuda.is_available()
    if not a.cpu and not on_gpu:
        raise SystemExit("no CUDA device: run with --cpu for the tiny CPU mode")
    torch.set_num_threads(1 if a.cpu else torch.get_num_threads())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    record: dict = {"world": world, "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
                    "torch": torch.__version__,
                    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None}
    if world > 1:
        dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(minutes=10))
    if rank == 0:
        out = compute_check(device, size=a.gemm_size, iters=50 if on_gpu else 3)
        print("== compute check (preflight's GEMM known-answer + memory fill) ==")
        print(_compute_table(out), flush=True)
        record["compute"] = out.to_dict()
    if world > 1:
        dist.barrier()
        iters = a.iters or (20 if on_gpu else 3)
        max_bytes = a.max_bytes or (8 * 2**30 if on_gpu else 2**20)
        sizes = size_ladder(2**20 if on_gpu else 1024, max_bytes, factor=16 if on_gpu else 8)
        rows = []
        for size in sizes:
            rows.append(measure_size(size, iters, device))
            if on_gpu:
                torch.cuda.empty_cache()
        if rank == 0:
            backend = "NCCL" if on_gpu else "gloo"
            print(f"== all-to-all over {world} ranks ({backend}, fp32, {iters} iters, median of per-iteration max) ==")
            print(format_table(rows), flush=True)
            record["alltoall"] = [asdict(r) for r in rows]
            if a.expect_busbw:
                status, reasons = judge_alltoall(rows, a.expect_busbw, 0.9)
                print(f"vs expected {a.expect_busbw} GB/s busbw at {rows[-1].bytes} B: "
                      f"{rows[-1].busbw_gbs / a.expect_busbw:.3f}x -> {status} {'; '.join(reasons)}")
                record["judged"] = {"expected_busbw_gbs": a.expect_busbw, "status": status, "reasons": reasons}
            record["nvls"] = os.environ.get("NCCL_NVLS_ENABLE")
        dist.destroy_process_group()
    if rank == 0 and a.json:
        a.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
