"""Spawn N CPU processes in one gloo group, run a module-level function on each, return the results by rank."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers_net import free_port


def _worker(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """One retry, only when the rendezvous port was taken between free_port() and the bind (other test processes
    on a shared machine pick ports too); any other failure propagates."""
    for attempt in range(2):
        with tempfile.TemporaryDirectory() as out_dir:
            try:
                mp.spawn(_worker, args=(world, free_port(), out_dir, fn, args), nprocs=world, join=True)
            except mp.ProcessRaisedException as e:
                if attempt == 0 and "address already in use" in str(e).lower():
                    continue
                raise
            return [torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world)]
    raise AssertionError("unreachable")
