"""A collective stuck on a peer that never joins fails after init_distributed's timeout (supervisor.hang_timeout_s
in the trainer), on the default group and on the groups build_groups creates, instead of gloo's 30-minute default."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch
from helpers_net import free_port

from moe_launch.conf.schema import ParallelConfig
from moe_launch.trainer.dist import DistEnv, init_distributed
from moe_launch.trainer.parallel.groups import build_groups

TIMEOUT_S = 3.0
_PEER_GIVES_UP_S = 60.0  # the absent rank exits after this: a missing timeout fails the test instead of hanging it


def _rank(rank: int, port: int, which: str, out: "mp.Queue", done: "mp.Event") -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_distributed(DistEnv(rank, 2, 0, "127.0.0.1", port, "torchrun"), torch.device("cpu"), timeout_s=TIMEOUT_S)
    groups = build_groups(ParallelConfig(dp=2))
    dist.barrier()  # both ranks are up; from here on rank 1 stays away
    if rank == 1:
        done.wait(_PEER_GIVES_UP_S)
        return
    group = groups.dp_group if which == "dp" else None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        out.put(("completed", time.monotonic() - t0))
    except RuntimeError as e:
        out.put((f"raised: {str(e)[:200]}", time.monotonic() - t0))
    done.set()


@pytest.mark.parametrize("which", ["world", "dp"])
def test_collective_on_an_absent_peer_times_out(which):
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, which, out, done), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        what, waited_s = out.get(timeout=_PEER_GIVES_UP_S + 60)
    finally:
        for p in procs:
            p.join(timeout=_PEER_GIVES_UP_S + 10)
            if p.is_alive():
                p.kill()
    assert what.startswith("raised"), what
    assert waited_s < _PEER_GIVES_UP_S, f"waited {waited_s:.1f} s: the peer's exit, not the timeout, ended it"
