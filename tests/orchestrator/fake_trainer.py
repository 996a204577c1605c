"""A stand-in that follows the trainer's run-directory contract, for unit tests of the supervisor's watcher only.

Not the trainer: no model, no torch. Per step it sleeps train.step_sleep_s, writes heartbeat/rank<r>.json, and rank 0
appends metrics.jsonl and (every train.ckpt_interval steps) checkpoints/fake.json, from which it resumes. It honours
train.fault_injection (nan -> fault record + exit 3, sigkill, hang, crash -> exit 1) on the configured attempt, or
on every attempt when FAKE_TRAINER_ALWAYS_INJECT=1 (a deterministic fault); on every rank when
FAKE_TRAINER_ALL_RANKS=1. End-to-end tests use the real trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from moe_launch.conf.load import load_config
from moe_launch.rundir import EXIT_SOFT_FAULT, RunDir, append_jsonl, node_name, write_json_atomic


def _lockstep(rd: RunDir, world: int, done: int) -> None:
    """Wait until every rank finished step `done`, as the collectives of a real step would (so all ranks stop at
    the same step when one fails)."""
    while True:
        steps = []
        for r in range(world):
            try:
                steps.append(json.loads((rd.heartbeat / f"rank{r}.json").read_text())["step"])
            except (OSError, ValueError, KeyError):
                steps.append(-1)
        if min(steps) >= done:
            return
        time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--attempt", type=int, default=0)
    args = ap.parse_args()
    rd = RunDir(args.run_dir)
    cfg = load_config(rd.config)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    host = node_name()
    ckpt = rd.checkpoints / "fake.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    fi = cfg.train.fault_injection
    every_rank = os.environ.get("FAKE_TRAINER_ALL_RANKS") == "1"  # e.g. a hang inside a collective: all ranks stop
    inject = fi.kind if fi.kind and (fi.rank == rank or every_rank) and (
        fi.attempt == args.attempt or os.environ.get("FAKE_TRAINER_ALWAYS_INJECT") == "1") else None
    signal.signal(signal.SIGUSR2, lambda *_: sys.exit(4))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    for step in range(start + 1, cfg.train.steps + 1):
        time.sleep(cfg.train.step_sleep_s)
        if step > start + 1:
            _lockstep(rd, world, step - 1)
        if inject and step == fi.step:
            if inject == "nan":
                write_json_atomic(rd.faults / f"{host}-rank{rank}-step{step}.json",
                                  {"host": host, "rank": rank, "step": step, "what": "non-finite loss nan",
                                   "time": time.time()})
                return EXIT_SOFT_FAULT
            if inject == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if inject == "hang":
                while True:
                    time.sleep(60)
            if inject == "crash":
                raise RuntimeError("injected crash")
        write_json_atomic(rd.heartbeat / f"rank{rank}.json",
                          {"step": step, "time": time.time(), "host": host, "pid": os.getpid()})
        if rank == 0:
            append_jsonl(rd.metrics, {"step": step, "loss": 10.0 / step, "tokens_per_s": 1000.0, "time": time.time()})
            if cfg.train.ckpt_interval and step % cfg.train.ckpt_interval == 0:
                write_json_atomic(ckpt, {"step": step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
