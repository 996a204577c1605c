"""Soft-fault detection, fault records, and the test-only fault injection hook.

A soft fault is a non-finite loss or gradient on one rank. Every rank checks its OWN loss and its OWN local
gradient (before the gradient reduction would spread a NaN to everyone), the flags are summed across ranks, and
only the faulty ranks write `faults/<host>-rank<r>-step<s>.json`, so the record names the node to exclude. All
ranks then exit with EXIT_SOFT_FAULT before the optimizer step and before any checkpoint of that step.

Injection (train.fault_injection, off by default) fires only on the configured rank, attempt and host:
  nan               the loss of step `step` becomes NaN (so do the gradients)
  inf_grad          one gradient element of step `step` becomes +inf
  hang              the rank stops making progress at step `step` (heartbeats stop)
  crash             the rank raises InjectedCrash at step `step` (a Python traceback, exit code 1)
  sigkill           the rank SIGKILLs itself at step `step`
  kill_during_ckpt  the rank SIGKILLs itself inside the first checkpoint at or after step `step`, after its shards
                    are on disk and before the manifest exists
  loss_spike        the loss of step `step` (so its gradients too; under pipeline parallelism the reported loss only)
                    is multiplied by SPIKE_FACTOR: finite, caught by spike detection (train.spike), not the NaN check
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import Optional

import torch

from moe_launch.conf.schema import FaultInjection
from moe_launch.rundir import RunDir, write_json_atomic


class InjectedCrash(RuntimeError):
    """Raised by the `crash` fault injection; never caught by the trainer."""


def active_injection(fi: FaultInjection, rank: int, attempt: int, host: str) -> Optional[str]:
    """The kind of fault this process must inject, or None. Pure."""
    if fi.kind is None or fi.rank != rank or fi.attempt != attempt:
        return None
    if fi.host is not None and fi.host != host:
        return None
    return fi.kind


def local_fault(loss: float, grad_norm: float) -> Optional[str]:
    """What is wrong with this rank's step (its loss and the norm of its own gradients), or None."""
    if not math.isfinite(loss):
        return f"non-finite loss {loss}"
    if not math.isfinite(grad_norm):
        return f"non-finite local gradient norm ({grad_norm})"
    return None


def fault_path(run_dir: RunDir, host: str, rank: int, step: int) -> Path:
    return run_dir.faults / f"{host}-rank{rank}-step{step}.json"


def write_fault_record(run_dir: RunDir, host: str, rank: int, step: int, what: str, **details: object) -> Path:
    path = fault_path(run_dir, host, rank, step)
    write_json_atomic(path, {"host": host, "rank": rank, "step": step, "what": what, "time": time.time(),
                             "pid": os.getpid(), **details})
    return path


def poison_loss(loss: torch.Tensor) -> torch.Tensor:
    return loss * float("nan")


def poison_grads(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.view(-1)[0] = float("inf")
            return


def hang_forever() -> None:
    while True:
        time.sleep(60)


def sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


SPIKE_FACTOR = 1000.0


def spike_loss(loss: torch.Tensor) -> torch.Tensor:
    """A finite spike: the loss and (through backward) every gradient of the step scaled by SPIKE_FACTOR."""
    return loss * SPIKE_FACTOR
