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
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, free_port(), out_dir, fn, args), nprocs=world, join=True)
        return [torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world)]
