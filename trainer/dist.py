"""Rank and rendezvous detection (torchrun or srun) and the few collectives the trainer itself needs.

`detect_env` is pure (environment in, DistEnv out). Under srun the supervisor passes MASTER_ADDR/MASTER_PORT; if
they are missing the master is the first host of SLURM_JOB_NODELIST as expanded by `scontrol show hostnames`.
`Comm` wraps torch.distributed for the trainer's bookkeeping (fault flags, checkpoint digests, barriers); with a
single process and no process group it answers locally, so unit tests need no rendezvous.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from moe_launch.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | slurm | single


def scontrol_hostnames(nodelist: str) -> list[str]:
    from moe_launch.orchestrator.slurm import hostnames  # the one wrapper of `scontrol show hostnames`

    return list(hostnames(nodelist))


def detect_env(env: Mapping[str, str], hostnames: Callable[[str], list[str]] = scontrol_hostnames) -> DistEnv:
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
        launcher = "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
        launcher = "slurm"
        if addr is None:
            addr = hostnames(env["SLURM_JOB_NODELIST"])[0]
        if port is None:  # same on every task of the job, different between concurrent jobs
            port = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    else:
        rank, world, local, launcher = 0, 1, 0, "single"
    if world > 1 and (addr is None or port is None):
        raise ConfigError("MASTER_ADDR", f"rank {rank} of {world} has no rendezvous address",
                          "launch with torchrun/srun or export MASTER_ADDR and MASTER_PORT")
    return DistEnv(rank, world, local, addr or "127.0.0.1", int(port or 29500), launcher)


HANG_MARGIN_S = 10.0


def collective_timeout_s(hang_timeout_s: float) -> float:
    """Slightly longer than the supervisor's hang timeout: the supervisor, which sees every rank's heartbeat and can
    name the node that fell behind, normally calls the hang first; the collective's own error is the backstop for
    a supervisor that cannot act (a rank blocked forever keeps its node's resources otherwise)."""
    return hang_timeout_s + HANG_MARGIN_S


_group_timeout: Optional[datetime.timedelta] = None  # init_distributed's, for every group this process creates


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float = 600.0) -> None:
    """Create the default process group: NCCL on GPU, gloo on CPU. A world of one needs none.

    `timeout_s` bounds the rendezvous and every collective, of this group and of the groups created later with
    `group_timeout()`: a collective stuck on a dead or hung peer fails after it instead of NCCL's 10 or gloo's 30
    minutes. The trainer passes `collective_timeout_s(supervisor.hang_timeout_s)`.
    """
    global _group_timeout
    if env.world_size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    _group_timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
        world_size=env.world_size, timeout=_group_timeout, device_id=device if device.type == "cuda" else None,
    )


def group_timeout() -> Optional[datetime.timedelta]:
    """The timeout for `dist.new_group`: without one a new group gets torch's default, not the default group's."""
    return _group_timeout


def pick_device(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Comm:
    """Collectives over the default group, or local answers for a single process without a group."""

    def __init__(self, device: torch.device = torch.device("cpu"), group: Optional[Any] = None):
        self.active = dist.is_initialized()
        self.group, self.device = group, device
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.active:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.group)
        return t


def settle() -> None:
    """Every rank has reached the end: after this barrier no rank talks to the rendezvous store any more, so the rank
    that hosts it may leave (a peer that loses the store mid-call aborts, which the supervisor would read as a node
    failure)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """`settle`, then release the process group (for a process that goes on after training)."""
    if dist.is_initialized():
        settle()
        dist.destroy_process_group()
