"""All-to-all bandwidth and correctness, measured the way nccl-tests' alltoall_perf reports it.

Definitions (nccl-tests, alltoall): `bytes` is the size of each rank's whole send buffer (n chunks, one per peer,
its own included); algbw = bytes / time; busbw = algbw * (n - 1) / n, because of the n chunks a rank sends, one
stays local. GB/s are 1e9 bytes/s. time is, per iteration, the slowest rank's time (the collective is only done when
every rank is), then the median over iterations (robust against one noisy iteration on a shared machine).

Correctness: every element carries a value determined by (source rank, destination rank, index), so the receiver
can recompute what it must have got; `wrong` counts mismatching elements over all ranks (nccl-tests' #wrong).

Run as a worker (one process per rank, started by health/exec.py):
    python -m moe_launch.health.alltoall --out result.json --sizes 1024,65536 --iters 5 [--delay-json '{"node2": 0.05}']
Rank and world come from RANK/WORLD_SIZE/LOCAL_RANK or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, the rendezvous
from MASTER_ADDR/MASTER_PORT. Rank 0 writes the JSON result (rows + the node of every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from moe_launch.rundir import node_name

ELEM_BYTES = 4  # fp32 payload, as nccl-tests' default float
_PATTERN_MOD = 65521  # values stay exact small integers in fp32


@dataclass
class A2ARow:
    bytes: int  # per rank send buffer
    time_s: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int


def algbw_gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def busbw_gbs(nbytes: int, seconds: float, nranks: int) -> float:
    return algbw_gbs(nbytes, seconds) * (nranks - 1) / nranks


def size_ladder(min_bytes: int, max_bytes: int, factor: int = 8) -> list[int]:
    """min, min*factor, ... and always max itself (the size baselines are judged on)."""
    sizes, s = [], max(min_bytes, 1)
    while s < max_bytes:
        sizes.append(s)
        s *= factor
    sizes.append(max_bytes)
    return sizes


def default_max_bytes(configured: int, on_gpu: bool) -> int:
    if configured > 0:
        return configured
    return 8 * 2**30 if on_gpu else 2**20


def chunk_elems(nbytes: int, world: int) -> int:
    """Elements per destination chunk: the buffer is rounded down to whole fp32 chunks (at least 1)."""
    return max(nbytes // ELEM_BYTES // world, 1)


def pattern(src: int, dst: int, n: int, device: torch.device) -> torch.Tensor:
    """What rank `src` sends to rank `dst` (n elements)."""
    # int32 keeps the temporaries of an 8 GiB buffer at half the size; every intermediate stays below 2^22
    i_N = torch.arange(n, device=device, dtype=torch.int32 if n < 2**31 else torch.int64) % _PATTERN_MOD
    return ((i_N * 31 + (src * 1009 + dst * 7) % _PATTERN_MOD) % _PATTERN_MOD).to(torch.float32)


def count_wrong(recv_WN: torch.Tensor, me: int) -> int:
    """recv_WN[s] is the chunk received from rank s."""
    world, n = recv_WN.shape
    return int(sum(int((recv_WN[s] != pattern(s, me, n, recv_WN.device)).sum()) for s in range(world)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: a CPU-GPU sync point, on purpose (timing)


def measure_size(
    nbytes: int, iters: int, device: torch.device, group: Optional[dist.ProcessGroup] = None, delay_s: float = 0.0
) -> A2ARow:
    """Collective: every rank of `group` calls it with the same arguments (delay_s may differ: the fault hook)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    n = chunk_elems(nbytes, world)
    send_WN = torch.stack([pattern(me, d, n, device) for d in range(world)])
    recv_WN = torch.full_like(send_WN, -1.0)
    dist.all_to_all_single(recv_WN, send_WN, group=group)  # warm-up, untimed, and the correctness sample
    _sync(device)
    wrong = torch.tensor([count_wrong(recv_WN, me)], dtype=torch.int64, device=device)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        if delay_s > 0:
            time.sleep(delay_s)  # fault injection: a slow node, inside the timed region
        dist.all_to_all_single(recv_WN, send_WN, group=group)
        _sync(device)
        times.append(time.perf_counter() - t0)
    t_I = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t_I, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM, group=group)
    t = statistics.median(t_I.tolist())
    real_bytes = n * world * ELEM_BYTES
    return A2ARow(real_bytes, t, algbw_gbs(real_bytes, t), busbw_gbs(real_bytes, t, world), int(wrong.item()))


def format_table(rows: list[A2ARow]) -> str:
    lines = [f"{'size (B)':>14} {'time (ms)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13} {'#wrong':>7}"]
    lines += [f"{r.bytes:>14} {r.time_s * 1e3:>11.3f} {r.algbw_gbs:>13.3f} {r.busbw_gbs:>13.3f} {r.wrong:>7}"
              for r in rows]
    return "\n".join(lines)


def this_node() -> str:
    """The node this rank runs on: MOE_LAUNCH_NODE (cluster=local), else Slurm's node name, else the hostname."""
    return node_name()


def _env_int(*names: str, default: Optional[int] = None) -> int:
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    if default is None:
        raise RuntimeError(f"none of {names} is set: start the worker through moe_launch.health.exec")
    return default


def worker_main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="one rank of the moe-health all-to-all test")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--sizes", required=True, help="comma-separated bytes per rank")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    p.add_argument("--delay-json", default="{}", help="node -> seconds added inside the timed region (test hook)")
    p.add_argument("--timeout-s", type=float, default=300)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rank = _env_int("RANK", "SLURM_PROCID")
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS")
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    backend = a.backend if a.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=a.timeout_s))
    try:
        node = this_node()
        nodes: list[Optional[str]] = [None] * world
        dist.all_gather_object(nodes, node)
        delay = float(json.loads(a.delay_json).get(node, 0.0))
        rows = [measure_size(int(s), a.iters, device, None, delay) for s in a.sizes.split(",")]
        if rank == 0:
            record = {"world": world, "rank_nodes": nodes, "backend": backend, "device": device.type,
                      "rows": [asdict(r) for r in rows], "iters": a.iters}
            a.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = a.out.with_name(a.out.name + ".tmp")
            tmp.write_text(json.dumps(record, indent=2))
            os.replace(tmp, a.out)
            print(format_table(rows), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(worker_main())
