"""Workers for the EP interop tests: real gloo process groups on CPU, one process per rank."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers_net import free_port


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, free_port(), out_dir, fn, args), nprocs=world, join=True)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def import_forward_save(rank: int, world: int, hf_dir: str, ckpt_dir: str, dp: int, ep: int, tokens: torch.Tensor):
    """Import the HF model into this rank's EP slice, run a forward through the real EP dispatcher, write a
    model-only checkpoint with the trainer's own writer, and gather the full state over the EP group."""
    from moe_launch.conf.schema import ParallelConfig
    from moe_launch.trainer.checkpoint import state as ckpt_state
    from moe_launch.trainer.checkpoint.layout import Coords
    from moe_launch.trainer.dist import Comm
    from moe_launch.trainer.interop.gather import gather_full_state
    from moe_launch.trainer.interop.hf import load_hf_into_model
    from moe_launch.trainer.interop.hf_config import model_config_from_hf, read_hf_config
    from moe_launch.trainer.model import build_model
    from moe_launch.trainer.parallel.dispatch import attach_dispatchers
    from moe_launch.trainer.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(dp=dp, ep=ep))
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    model = build_model(cfg, groups.ep_rank, groups.ep_size).eval()
    attach_dispatchers(model, cfg, groups)
    load_hf_into_model(model, hf_dir, groups.ep_rank, groups.ep_size)
    with torch.no_grad():
        logits = model(tokens)
    coords = Coords(rank=rank, dp_rank=groups.dp_rank, ep_rank=groups.ep_rank, ep_size=groups.ep_size,
                    optimizer_sharding="none", is_moe=True)
    from dataclasses import asdict

    ckpt_state.save(Path(ckpt_dir), 7, coords, model, None, {}, Comm(), torch.device("cpu"), model_only=True,
                    meta={"model": asdict(cfg)})
    full = gather_full_state(model, groups.ep_group)
    return {"logits": logits, "full": full, "e_local": model.blocks[0].ffn.w_up_EFD.shape[0]}
