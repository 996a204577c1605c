"""Helpers of the trainer tests: tiny configs, run directories, rank launchers (imported as `trainer_harness`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers_net import free_port

from moe_launch.conf.load import dump_config
from moe_launch.conf.schema import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RootConfig,
    TrainConfig,
)
from moe_launch.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512
SEQ = 32


def tiny_cfg(data_cache: str, dp: int = 1, ep: int = 1, optimizer_sharding: str = "none", **train) -> RootConfig:
    model = ModelConfig(name="test_moe", kind="moe", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                        max_seq_len=SEQ, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32))
    t = dict(steps=8, global_batch_size=4, micro_batch_size=2, seq_len=SEQ, lr=3e-3, min_lr=3e-4, warmup_steps=2,
             ckpt_interval=2, deterministic=True, progress=False)
    t.update(train)
    return RootConfig(model=model, parallel=ParallelConfig(dp=dp, ep=ep, optimizer_sharding=optimizer_sharding),
                      train=TrainConfig(**t), data=DataConfig(cache_dir=data_cache, workers=1),
                      cluster=ClusterConfig(kind="local", nodes=dp * ep, tasks_per_node=1))


def write_run(root: Path, cfg: RootConfig) -> RunDir:
    rd = RunDir(root).make()
    dump_config(cfg, rd.config)
    return rd


def launch_ranks(rd: RunDir, world: int, attempt: int = 0, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run `python -m moe_launch.trainer` once per rank (torchrun-style env), each rank on its own "node". A rank
    still running at the timeout is aborted with every thread's stack printed (faulthandler), and the test fails
    with each rank's output, so that a hang says where it hung."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), MOE_LAUNCH_NODE=f"node{r}", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "moe_launch.trainer", "--run-dir", str(rd.root), "--attempt", str(attempt)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    out, hung = [], []
    try:
        for p in procs:
            try:
                stdout, _ = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGABRT)  # faulthandler prints all threads' stacks on SIGABRT
                try:
                    stdout, _ = p.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    stdout, _ = p.communicate()
                hung.append(len(out))
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if hung:
        report = "\n".join(f"--- rank {r} (exit {c.returncode}{', hung' if r in hung else ''}):\n{c.stdout[-6000:]}"
                           for r, c in enumerate(out))
        raise AssertionError(f"ranks {hung} still running after {timeout:.0f} s:\n{report}")
    return out
