"""Fault paths of one rank: Inf gradient, SIGUSR2 preemption, SIGKILL inside a checkpoint write."""

import json
import os
import signal
import subprocess
import sys
import time

import torch
from trainer_harness import REPO, tiny_cfg, write_run

from moe_launch.conf.schema import FaultInjection
from moe_launch.rundir import EXIT_OK, EXIT_PREEMPTED, EXIT_SOFT_FAULT, read_jsonl
from moe_launch.trainer.checkpoint.store import choose_resume_slot
from moe_launch.trainer.loop import Trainer

torch.set_num_threads(1)


def _start(rd, attempt=0):
    env = dict(os.environ, MOE_LAUNCH_NODE="nodeX", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "moe_launch.trainer", "--run-dir", str(rd.root),
                             "--attempt", str(attempt)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_inf_gradient_is_a_soft_fault_before_the_step(tmp_path, data_cache):
    cfg = tiny_cfg(data_cache, fault_injection=FaultInjection(kind="inf_grad", rank=0, step=3))
    rd = write_run(tmp_path / "run", cfg)
    trainer = Trainer(cfg, rd)
    assert trainer.train() == EXIT_SOFT_FAULT
    record = json.loads(next(rd.faults.iterdir()).read_text())
    assert record["step"] == 3 and "gradient" in record["what"]
    assert trainer.optimizer.step_count == 2  # the poisoned gradients never reached the weights
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert choose_resume_slot(rd.checkpoints).step == 2


def test_sigusr2_checkpoints_and_exits_preempted(tmp_path, data_cache):
    rd = write_run(tmp_path / "run", tiny_cfg(data_cache, steps=40, ckpt_interval=0, step_sleep_s=0.5))
    proc = _start(rd)
    try:
        beat = rd.heartbeat / "rank0.json"
        deadline = time.monotonic() + 180
        while not beat.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert beat.exists(), proc.stdout.read() if proc.poll() is not None else "no heartbeat"
        proc.send_signal(signal.SIGUSR2)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    stop = [e for e in read_jsonl(rd.journal) if e["kind"] == "stop"]
    assert len(stop) == 1
    step = stop[0]["details"]["step"]
    assert 1 <= step < 40 and choose_resume_slot(rd.checkpoints).step == step
    assert max(r["step"] for r in read_jsonl(rd.metrics)) == step


def test_sigkill_during_checkpoint_keeps_the_previous_one(tmp_path, data_cache):
    cfg = tiny_cfg(data_cache, steps=6, fault_injection=FaultInjection(kind="kill_during_ckpt", rank=0, step=4))
    rd = write_run(tmp_path / "run", cfg)
    proc = _start(rd)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    assert (rd.checkpoints / ".ckpt-b.tmp").is_dir() and not (rd.checkpoints / "ckpt-b").exists()
    assert choose_resume_slot(rd.checkpoints).step == 2
    proc = _start(rd, attempt=1)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_OK, out[-3000:]
    resume = [e for e in read_jsonl(rd.journal) if e["kind"] == "resume"]
    assert resume[0]["details"]["step"] == 2 and resume[0]["details"]["fell_back"] is False
    assert choose_resume_slot(rd.checkpoints).step == 6
