"""What the supervisor needs from a cluster, whichever kind: the allocation's nodes, and trainer steps.

Two implementations: local_cluster.py (groups of local processes stand in for nodes) and slurm.py (srun steps inside
the allocation). The supervisor only talks to these two small interfaces. Every srun command line (trainer step,
node probe, health task of health/exec.py) is built by one pure function, srun.srun_argv; local health tasks run
through local_cluster.LocalStep, the launcher of the local trainer.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous (MASTER_PORT) of trainer or health ranks."""
    with socket.socket() as s:
        s.bind(("", 0))
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
