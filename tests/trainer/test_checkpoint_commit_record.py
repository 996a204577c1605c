"""A checkpoint is on record the moment it is valid. Rank 0 renames the directory into place and only then tells the
other ranks; a peer lost during that last exchange fails the persist, yet the checkpoint is valid and the next attempt
resumes from it. The record (`on_commit`, which the trainer journals) must therefore come from the commit itself,
not from the end of the persist."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch
from helpers_net import free_port

from moe_launch.trainer.checkpoint.persist import AsyncCheckpointer, Target
from moe_launch.trainer.checkpoint.store import choose_resume_slot
from moe_launch.trainer.dist import Comm, DistEnv, init_distributed

TIMEOUT_S = 20.0


def _rank(rank: int, port: int, root: str, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    init_distributed(DistEnv(rank, 2, 0, "127.0.0.1", port, "torchrun"), torch.device("cpu"), timeout_s=TIMEOUT_S)
    comm = Comm(torch.device("cpu"))
    if rank == 1:
        # the peer's shards are on disk and gathered; it dies while rank 0 commits (a node lost mid-checkpoint)
        comm.broadcast_object = lambda obj, src=0: os._exit(0)
    committed, ended = [], []
    writer = AsyncCheckpointer(torch.device("cpu"), comm, ended.append, on_commit=committed.append)
    rel = f"model/rank{rank}.pt"
    writer.request(3, [Target(root + "/ckpt-a", {rel: lambda host: host[rel]})], {rel: {"w": torch.ones(64) * rank}})
    try:
        writer.wait()
        outcome = "ended"
    except Exception as e:  # the lost peer fails the last exchange
        outcome = f"raised {type(e).__name__}"
    out.put((outcome, [(r.step, r.done, r.bytes) for r in committed], len(ended)))


def test_a_checkpoint_valid_when_a_peer_is_lost_is_on_record(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        outcome, committed, ended = out.get(timeout=TIMEOUT_S + 120)
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S + 30)
            if p.is_alive():
                p.kill()
    choice = choose_resume_slot(tmp_path)
    assert (choice.path.name, choice.step) == ("ckpt-a", 3)  # valid: the next attempt resumes from it
    assert len(committed) == 1, (outcome, ended)
    step, done, nbytes = committed[0]
    assert step == 3 and done == [str(tmp_path / "ckpt-a")] and nbytes > 2 * 64 * 4
