"""What the supervisor needs from a cluster, whichever kind: the allocation's nodes, and trainer steps.

Two implementations: local_cluster.py (groups of local processes stand in for nodes) and slurm.py (srun steps inside
the allocation). The supervisor only talks to these two small interfaces. Every srun command line (trainer step,
node probe, health task of health/exec.py) is built by one pure function, srun.srun_argv; local health tasks run
through local_cluster.LocalStep, the launcher of the local trainer.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default first ephemeral port


def rendezvous_ports(ip_local_port_range: Optional[str]) -> range:
    """Pure: where a rendezvous port is drawn from: the 10,000 ports just below the kernel's ephemeral range (its
    first number in `ip_local_port_range`, e.g. "32768\t60999"). A port inside that range can be taken by any
    outgoing connection between our check and the trainer's bind, which on a busy host ended a launch with
    EADDRINUSE at the rendezvous; below it the kernel never hands a port out by itself."""
    try:
        low = int(ip_local_port_range.split()[0]) if ip_local_port_range else _DEFAULT_EPHEMERAL_LOW
    except (ValueError, IndexError):
        low = _DEFAULT_EPHEMERAL_LOW
    low = max(low, 2048)
    return range(max(1024, low - 10_000), low)


def free_port(host: str = "", rng: Optional[random.Random] = None) -> int:
    """A TCP port free on this host now, for a rendezvous (MASTER_PORT) of trainer or health ranks: a random one of
    `rendezvous_ports` that binds; the kernel's choice only if none of 64 tries does."""
    try:
        text = _PORT_RANGE_FILE.read_text()
    except OSError:
        text = None
    ports, rng = rendezvous_ports(text), rng or random.Random()
    for _ in range(64):
        port = rng.choice(ports)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class StepResult:
    """How a trainer step ended. `dead_nodes`: the node (not the program) failed; `failed_nodes`: tasks there exited
    non-zero on their own. `code`: the first bad exit code (0 when all tasks succeeded)."""

    code: int
    dead_nodes: tuple[str, ...] = ()
    failed_nodes: tuple[str, ...] = ()
    detail: str = ""


class Step(Protocol):
    attempt: int
    nodes: tuple[str, ...]

    def poll(self) -> Optional[StepResult]:
        """Non-blocking: the result once every task has ended (or is known dead), else None."""

    def terminate(self, signal_name: str = "USR2") -> None:
        """Ask the trainer to checkpoint and exit (the preemption path)."""

    def kill(self) -> None:
        """End every task of the step now; idempotent."""


class Cluster(Protocol):
    kind: str

    def allocation(self) -> tuple[str, ...]:
        """Nodes the allocation holds now, in the scheduler's order (rank 0 goes to the first of a step's nodes)."""

    def unavailable(self, nodes: tuple[str, ...]) -> dict[str, str]:
        """Of `nodes`, those the scheduler reports down / not responding / gone: node -> state."""

    def probe(self, nodes: tuple[str, ...]) -> set[str]:
        """Of `nodes`, those that start a trivial task now: asked before a spare is swapped in, because the scheduler
        may not have noticed yet that it died."""

    def launch(self, nodes: tuple[str, ...], attempt: int, argv: list[str], env: dict[str, str],
               log_dir: Path) -> Step:
        """Start the trainer on `nodes` (tasks_per_node ranks each) with MASTER_ADDR/MASTER_PORT in `env`."""

    def master_addr(self, nodes: tuple[str, ...]) -> str:
        """Address of the node that will host rank 0 of a step on `nodes`."""
