"""What the supervisor observes. Each observation becomes one immutable event fed to `decide()`.

Events carry the trainer `attempt` they belong to, so a late observation of an attempt that has already been
replaced (a fault record read after the relaunch, the old srun step finally exiting) is recognised and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class PreflightDone:
    """Initial health checks over the whole allocation (or skipped: every node counts as healthy)."""

    healthy: tuple[str, ...]
    failed: dict[str, str] = field(default_factory=dict)  # node -> why


@dataclass(frozen=True)
class StepExited:
    """The trainer step (all ranks) ended. `dead_nodes`: nodes the step lost (node failure, tasks killed by a signal,
    node gone from the allocation); `failed_nodes`: nodes whose tasks exited non-zero on their own."""

    attempt: int
    code: int
    dead_nodes: tuple[str, ...] = ()
    failed_nodes: tuple[str, ...] = ()
    step: int = -1  # last step any rank reported (heartbeats), -1 when unknown
    detail: str = ""


@dataclass(frozen=True)
class Fault:
    """A trainer fault record (faults/<host>-rank<r>-step<s>.json): NaN/Inf on one rank."""

    attempt: int
    node: str
    rank: int
    step: int
    what: str


@dataclass(frozen=True)
class Hang:
    """No heartbeat advanced for supervisor.hang_timeout_s. `suspects`: nodes whose ranks stopped first."""

    attempt: int
    suspects: tuple[str, ...]
    step: int
    idle_s: float


@dataclass(frozen=True)
class NodesLost:
    """The scheduler no longer lists these nodes in the allocation, or reports them down."""

    nodes: tuple[str, ...]
    detail: str = ""


@dataclass(frozen=True)
class SuspectChecked:
    """Result of re-running preflight on a node set aside after a soft fault or a hang."""

    node: str
    healthy: bool
    detail: str = ""


@dataclass(frozen=True)
class Probed:
    """Result of probing the nodes of a hung attempt (compute check, all-to-all with isolation) before a relaunch."""

    attempt: int
    step: int
    healthy: tuple[str, ...]
    failed: dict[str, str] = field(default_factory=dict)  # node -> why
    detail: str = ""  # why nothing was checked, when nothing was


@dataclass(frozen=True)
class LaunchTimeout:
    """No rank wrote a heartbeat within supervisor.launch_timeout_s of the launch."""

    attempt: int


@dataclass(frozen=True)
class StopRequested:
    reason: str = "stop requested by the user (moe-launch stop)"


@dataclass(frozen=True)
class AllocationEnding:
    """The supervisor got SIGUSR2: Slurm's warning before the time limit (`--signal=B:USR2@N`) or a preemption."""

    reason: str = "the allocation is ending (time-limit or preemption signal)"


Event = Union[PreflightDone, StepExited, Fault, Hang, NodesLost, SuspectChecked, Probed, LaunchTimeout,
              StopRequested, AllocationEnding]
