"""Checkpoint cost at the 4-layer OLMoE shape: the trainer's asynchronous checkpoint against
torch.distributed.checkpoint (DCP) sync save and async_save with pinned staging, and restore against dcp.load, all in
one run on one GPU.

Run on one GPU:   PYTHONUNBUFFERED=1 python benchmarks/checkpoint.py --out $OUT --dir /path/on/the/disk
CPU smoke test:   python benchmarks/checkpoint.py --smoke

The state is the trainer's own: `build_model` at model=olmoe_1b7b with n_layers=4, bf16 parameters, the trainer's
optimizer (fp32 master as bf16 parameter + int16 remainder, fp32 moments filled with random values), so a checkpoint
is the same 26.6 GB of files the trainer writes. Measured, in this order, on the same directory:

  disk        write+fsync and read (page cache dropped) of a 4 GiB file: the disk-bound times of this state
  ours        the host buffers reserved (allocated and pinned in a background thread, as at the trainer's start),
              then a checkpoint as the trainer takes it:
              stall (training blocked) and durable (manifest renamed into place), with bf16 matmuls running on the
              GPU meanwhile (their slowdown against an idle-disk baseline is reported)
  restore     the trainer's resume path: the newest slot's digest check (PendingResume, a thread of its own) while
              the model and optimizer load from it, then the check's verdict; and, for comparison, the check first
              and the loads after it (train.* has no switch for this: a trainer checks first only after a failed check)
  dcp sync    dcp.save of the same tensors (model parameters, parameter shard, remainder, moments)
  dcp async   dcp.async_save with DefaultStager(pinned, async staging): blocking, staged, durable
  dcp.load    into the same GPU tensors

Each checkpoint is deleted before the next is written (the GPU machine's disk holds about two). Prints one JSON
line per measurement and a table last; writes checkpoint.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from moe_launch.conf import presets
from moe_launch.conf.schema import ParallelConfig, TrainConfig
from moe_launch.trainer.checkpoint import layout
from moe_launch.trainer.checkpoint import state as ckpt_state
from moe_launch.trainer.checkpoint.persist import AsyncCheckpointer, Target
from moe_launch.trainer.checkpoint.store import PendingResume, checkpoint_bytes, choose_resume_slot
from moe_launch.trainer.dist import Comm
from moe_launch.trainer.dtypes import cast_parameters
from moe_launch.trainer.model import build_model
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import build_optimizer

ROWS: list[dict] = []


def emit(**row) -> dict:
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drop_caches() -> bool:
    """Drop the page cache so reads come from the disk (root only; False when refused)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def build_state(smoke: bool, device: torch.device, layers: int = 4):
    model_cfg = dataclasses.replace(presets.MODELS["tiny_moe" if smoke else "olmoe_1b7b"],
                                    n_layers=2 if smoke else layers)
    parallel = ParallelConfig()
    groups = build_groups(parallel)
    torch.manual_seed(0)
    model = build_model(model_cfg, 0, 1, device)
    cast_parameters(model, torch.bfloat16)
    opt = build_optimizer(model, TrainConfig(), parallel, groups)
    g = torch.Generator(device=device).manual_seed(1)
    for b in opt.buckets:  # a trained optimizer's state: nothing compresses, nothing is zero
        b.exp_avg.normal_(generator=g)
        b.exp_avg_sq.uniform_(generator=g)
        b.remainder.random_(-(1 << 15), 1 << 15, generator=g)
    coords = layout.Coords(rank=0, dp_rank=0, ep_rank=0, ep_size=1, optimizer_sharding="none", is_moe=True)
    sync(device)
    return model, opt, coords


def disk_bound(root: Path, nbytes: int, device: torch.device) -> tuple[float, float]:
    """(write+fsync GB/s, read GB/s) of one file of `nbytes` from a pinned (CUDA) or plain host buffer."""
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf.random_(0, 255)
    path = root / "disk-probe.bin"
    view = memoryview(buf.numpy())
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    done = 0
    while done < nbytes:
        done += os.write(fd, view[done:])
    os.fsync(fd)
    os.close(fd)
    write_gbs = nbytes / (time.perf_counter() - t0) / 1e9
    dropped = drop_caches()
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    read_gbs = nbytes / (time.perf_counter() - t0) / 1e9
    path.unlink()
    emit(what="disk", probe_bytes=nbytes, write_fsync_GBps=round(write_gbs, 3), read_GBps=round(read_gbs, 3),
         page_cache_dropped=dropped)
    return write_gbs, read_gbs


class MatmulLoad:
    """bf16 matmuls on the GPU in the main thread while a checkpoint persists; ms per matmul."""

    def __init__(self, device: torch.device, n: int):
        self.device = device
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def run(self, seconds: float = 0.0, until: threading.Event | None = None, iters: int = 20) -> float:
        times, t_end = [], time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            for _ in range(iters):
                self.a @ self.a
            sync(self.device)
            times.append((time.perf_counter() - t0) / iters * 1e3)
            if (until is not None and until.is_set()) or (until is None and time.perf_counter() > t_end):
                return sorted(times)[len(times) // 2]


def ours(root: Path, model, opt, coords, device: torch.device, load: MatmulLoad, disk_write_gbs: float) -> Path:
    files = ckpt_state.FileNames.of(coords)
    rels = layout.writes(coords)
    writer = AsyncCheckpointer(device, Comm(device), lambda r: None)
    trainer_state = {"step": 1, "layout": {"dp": 1, "ep": 1, "pp": 1, "optimizer_sharding": "none"}}

    def state():
        return ckpt_state.device_state(rels, files, model, opt, trainer_state, device)

    baseline_ms = load.run(seconds=2.0)
    t0 = time.perf_counter()
    writer.snapshot.reserve(state())  # as the trainer does at its start: pinning in the background
    reserving = writer.snapshot._reserving
    reserve_ms = load.run(until=_joined_event(reserving))
    emit(what="ours_reserve", seconds=round(time.perf_counter() - t0, 3), pinned_bytes=writer.snapshot.nbytes,
         matmul_ms_idle=round(baseline_ms, 3), matmul_ms_while_pinning=round(reserve_ms, 3))
    slot = root / "ckpt-a"
    targets = [Target(slot, {rel: ckpt_state.file_object(rel, files, writer.snapshot.scratch) for rel in rels})]
    done = threading.Event()
    writer.on_result = lambda r: done.set()
    stall_s, _ = writer.request(1, targets, state())
    writer.fence()
    busy_ms = load.run(until=done)
    result = writer.wait()
    nbytes = checkpoint_bytes(slot)
    emit(what="ours_async", ok=result.ok, stall_s=round(stall_s, 4), durable_s=round(result.durable_s, 2),
         bytes=nbytes, disk_bound_s=round(nbytes / disk_write_gbs / 1e9, 2),
         durable_over_disk_bound=round(result.durable_s / (nbytes / disk_write_gbs / 1e9), 3),
         pinned_bytes=writer.snapshot.nbytes, scratch_bytes=writer.snapshot.scratch_bytes,
         matmul_ms_idle=round(baseline_ms, 3), matmul_ms_while_persisting=round(busy_ms, 3))
    writer.close()
    del writer
    return slot


def _joined_event(thread: threading.Thread) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (thread.join(), done.set()), daemon=True).start()
    return done


def restore_ours(root: Path, model, opt, coords, device: torch.device, disk_read_gbs: float) -> None:
    for overlapped in (True, False):
        dropped = drop_caches()
        t0 = time.perf_counter()
        if overlapped:
            pending = PendingResume(root)
            path = pending.choice.path
        else:
            path = choose_resume_slot(root).path
        t_choice = time.perf_counter() - t0
        ckpt_state.load_model(path, coords, model)
        ckpt_state.load_optimizer(path, coords, opt)
        sync(device)
        t_load = time.perf_counter() - t0 - t_choice
        ok = pending.confirm()[0] if overlapped else True
        total = time.perf_counter() - t0
        nbytes = checkpoint_bytes(path)
        emit(what="ours_restore" if overlapped else "ours_restore_check_first", seconds=round(total, 2), ok=ok,
             verify_s=round(t_choice if not overlapped else total, 2), load_s=round(t_load, 2), bytes=nbytes,
             disk_read_bound_s=round(nbytes / disk_read_gbs / 1e9, 2), page_cache_dropped=dropped)


def dcp_state(model, opt) -> dict[str, torch.Tensor]:
    """The same tensors as our files hold (the master as parameter shard + remainder, as it lives on the GPU)."""
    sd = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    for b in opt.buckets:
        sd[f"optim.{b.name}.param_shard"] = b.param_shard
        sd[f"optim.{b.name}.remainder"] = b.remainder
        sd[f"optim.{b.name}.exp_avg"] = b.exp_avg
        sd[f"optim.{b.name}.exp_avg_sq"] = b.exp_avg_sq
    return sd


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def dcp_runs(root: Path, model, opt, device: torch.device, disk_write_gbs: float, disk_read_gbs: float,
             with_async: bool = True) -> None:
    import torch.distributed.checkpoint as dcp

    sd = dcp_state(model, opt)
    path = root / "dcp-sync"
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    emit(what="dcp_sync_save", seconds=round(time.perf_counter() - t0, 2), bytes=dir_bytes(path))
    if not with_async:  # dcp.load reads the synchronous save instead
        dcp_load(sd, path, device, disk_read_gbs)
        return
    shutil.rmtree(path)

    path = root / "dcp-async"
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=device.type == "cuda", use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=device.type == "cuda"))
    except ImportError:
        stager = None
    t0 = time.perf_counter()
    response = dcp.async_save(sd, checkpoint_id=str(path), no_dist=True, async_stager=stager)
    blocking = time.perf_counter() - t0
    staged = None
    if hasattr(response, "upload_completion"):
        response.staging_completion.result()
        staged = time.perf_counter() - t0
        response.upload_completion.result()
    else:
        response.result()
    durable = time.perf_counter() - t0
    nbytes = dir_bytes(path)
    emit(what="dcp_async_save_pinned", blocking_s=round(blocking, 4), staged_s=None if staged is None else
         round(staged, 2), durable_s=round(durable, 2), bytes=nbytes,
         durable_over_disk_bound=round(durable / (nbytes / disk_write_gbs / 1e9), 3))
    if stager is not None:
        stager.close()

    dcp_load(sd, path, device, disk_read_gbs)


def dcp_load(sd: dict[str, torch.Tensor], path: Path, device: torch.device, disk_read_gbs: float) -> None:
    import torch.distributed.checkpoint as dcp

    nbytes = dir_bytes(path)
    dropped = drop_caches()
    t0 = time.perf_counter()
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    sync(device)
    emit(what="dcp_load", seconds=round(time.perf_counter() - t0, 2), bytes=nbytes, page_cache_dropped=dropped,
         disk_read_bound_s=round(nbytes / disk_read_gbs / 1e9, 2))
    shutil.rmtree(path)


def ratio(row: dict) -> object:
    return round(row["seconds"] / row["disk_read_bound_s"], 3) if row.get("disk_read_bound_s") else None


def table() -> str:
    by = {r["what"]: r for r in ROWS}
    d, o, r = by.get("disk", {}), by.get("ours_async", {}), by.get("ours_restore", {})
    rf = by.get("ours_restore_check_first", {})
    s, a, lo = by.get("dcp_sync_save", {}), by.get("dcp_async_save_pinned", {}), by.get("dcp_load", {})
    gb = o.get("bytes", 0) / 1e9
    lines = [
        f"state {gb:.1f} GB; disk write+fsync {d.get('write_fsync_GBps')} GB/s, read {d.get('read_GBps')} GB/s",
        "| writer | training blocked s | until durable s | durable / disk-bound |",
        "|---|---|---|---|",
        f"| ours (async, pinned host buffers) | {o.get('stall_s')} | {o.get('durable_s')} | "
        f"{o.get('durable_over_disk_bound')} |",
        f"| dcp.save (sync) | {s.get('seconds')} | {s.get('seconds')} | |",
        f"| dcp.async_save (pinned staging) | {a.get('blocking_s')} | {a.get('durable_s')} | "
        f"{a.get('durable_over_disk_bound')} |",
        "| restore | seconds | disk-read-bound s | over the bound |",
        f"| ours (check while loading; loads done at {r.get('load_s')}) | {r.get('seconds')} | "
        f"{r.get('disk_read_bound_s')} | {ratio(r)} |",
        f"| ours, check first (verify {rf.get('verify_s')} + load {rf.get('load_s')}) | {rf.get('seconds')} | "
        f"{rf.get('disk_read_bound_s')} | {ratio(rf)} |",
        f"| dcp.load | {lo.get('seconds')} | {lo.get('disk_read_bound_s')} | {ratio(lo)} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/ckpt-bench-out"))
    ap.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: under --out)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, measures nothing")
    ap.add_argument("--skip-dcp", action="store_true", help="ours only (the DCP rows of an earlier run stand)")
    ap.add_argument("--skip-dcp-async", action="store_true", help="DCP: the synchronous save and dcp.load only")
    ap.add_argument("--layers", type=int, default=4, help="model.n_layers of the OLMoE-1B-7B state")
    args = ap.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    root = args.dir or args.out / "ckpt"
    root.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    emit(what="env", torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
         cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
         disk=subprocess.run(["df", "-h", str(root)], capture_output=True, text=True).stdout.splitlines()[-1])
    model, opt, coords = build_state(args.smoke, device, args.layers)
    write_gbs, read_gbs = disk_bound(root, (1 << 22) if args.smoke else (4 << 30), device)
    load = MatmulLoad(device, 256 if args.smoke else 8192)
    slot = ours(root, model, opt, coords, device, load, write_gbs)
    restore_ours(root, model, opt, coords, device, read_gbs)
    shutil.rmtree(slot)
    if not args.skip_dcp:
        dcp_runs(root, model, opt, device, write_gbs, read_gbs, with_async=not args.skip_dcp_async)
    (args.out / "checkpoint.json").write_text(json.dumps(ROWS, indent=1))
    print(table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
