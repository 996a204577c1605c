"""Run functions on CPU processes joined by a real gloo process group and collect what each returns.

Starting a process costs seconds (importing torch) on the 2-core CI machine, far more than the tiny runs the tests
do, so a `RankPool` starts its processes once and runs many jobs: for each job the first `world` workers create a
fresh gloo group on a new port, call fn(rank, world, *args), tear the group down and send the result back.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers_net import free_port

JOB_TIMEOUT_S = 300  # a deadlocked collective fails the test instead of hanging the suite
GLOO_TIMEOUT_S = 120


def _serve(rank: int, jobs: "mp.Queue", results: "mp.Queue") -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, world, port, args = job
        if rank >= world:
            continue
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
            try:
                buf = io.BytesIO()
                torch.save(fn(rank, world, *args), buf)  # bytes, not shared-memory tensors: nothing outlives the job
                out = ("ok", buf.getvalue())
            finally:
                dist.destroy_process_group()
                torch.use_deterministic_algorithms(False)
        except BaseException:  # noqa: B902 - report anything, the pool must stay alive
            out = ("error", traceback.format_exc())
        results.put((rank, out))


class RankPool:
    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        self.size = size
        self.jobs = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, self.jobs[r], self.results), daemon=True)
                      for r in range(size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
        """fn(rank, world, *args) on ranks 0..world-1 of a new gloo group; results by rank. `fn` must be a
        module-level function (it is pickled by name)."""
        assert world <= self.size
        port = free_port()
        for r in range(world):
            self.jobs[r].put((fn, world, port, args))
        got: dict[int, Any] = {}
        errors = []
        for _ in range(world):
            try:
                rank, (status, value) = self.results.get(timeout=JOB_TIMEOUT_S)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{fn.__name__}: no result within {JOB_TIMEOUT_S}s (deadlock?); "
                                   "pool stopped") from None
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            got[rank] = torch.load(io.BytesIO(value), weights_only=False) if status == "ok" else None
        if errors:
            raise RuntimeError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return [got[r] for r in range(world)]

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        deadline = time.monotonic() + 3  # interpreter shutdown of an idle worker is slow on a loaded machine
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()  # idle and holding nothing: safe to end
                p.join()
