"""The cross-allocation policy, beside decide() (which rules within one allocation): whether an allocation that ended
without a summary gets a successor, and how many buffers that successor asks for. Pure functions over the journal's
records and the config; orchestrator/login.py applies them.
"""

from __future__ import annotations

from typing import Any, Optional

from moe_launch.conf.schema import ClusterConfig, SupervisorConfig
from moe_launch.orchestrator.plan import PartitionInfo


def allocation_verdict(continuation: bool, records: list[dict[str, Any]], started: int,
                       sup: SupervisorConfig) -> Optional[str]:
    """Pure: why the run stops instead of getting allocation number `started` (0-based), or None to resubmit.
    `continuation`: the ended allocation's trainer checkpointed cleanly on a time-limit or preemption signal. Such
    allocations are planned (a two-week run on 24-hour limits needs 14), so they never use up
    supervisor.max_resubmits, which counts allocations lost without a clean checkpoint; supervisor.max_allocations
    (0: none) caps them all."""
    if sup.max_allocations and started >= sup.max_allocations:
        return (f"supervisor.max_allocations={sup.max_allocations} allocation(s) used up. Checkpoints are kept: "
                f"`moe-launch attach` after raising it resumes from them")
    lost = sum(1 for r in records if r.get("kind") == "resubmit" and not r["details"].get("continuation"))
    if not continuation and lost >= sup.max_resubmits:
        return (f"the allocation ended without a clean checkpoint {lost + 1} time(s); supervisor.max_resubmits="
                f"{sup.max_resubmits} used up. Checkpoints are kept: `moe-launch attach` after raising it, or start "
                f"a new run resuming from them")
    return None


def _usable(part: PartitionInfo, exclude: tuple[str, ...]) -> list[str]:
    return [n for n in part.nodes if n not in exclude and n not in part.unavailable]


def buffers_for_resubmit(cluster: ClusterConfig, part: Optional[PartitionInfo], exclude: tuple[str, ...]) -> int:
    """Pure: the buffer count a resubmission asks for: cluster.buffers, or fewer when the partition, less the excluded
    and unavailable nodes, cannot give N + B any more (down to 0). A job asking for more would never start, or be
    refused."""
    if part is None:
        return cluster.buffers
    return max(0, min(cluster.buffers, len(_usable(part, exclude)) - cluster.nodes))


def pending_cannot_start(part: Optional[PartitionInfo], nodes: int, buffers: int,
                         exclude: tuple[str, ...]) -> Optional[str]:
    """Pure: why a pending allocation of N + B nodes is cancelled and submitted again with fewer buffers, or None to
    let it pend. It is cancelled when the partition, less the excluded and unavailable nodes, no longer gives N + B
    but still gives N: a node died after the request was sized (a spare lost together with the previous allocation
    that the scheduler marked down only later). With fewer than N usable it pends: nodes may come back."""
    if part is None or buffers <= 0:
        return None
    usable = _usable(part, exclude)
    if not nodes <= len(usable) < nodes + buffers:
        return None
    down = sorted(n for n in part.unavailable if n not in exclude)
    return (f"it asks for {nodes + buffers} nodes, the partition has {len(usable)} usable "
            f"({', '.join(down)} unavailable)")


def submitted_at(records: list[dict[str, Any]], handle: str) -> float:
    """Pure: when the login side submitted allocation `handle` (journal time of its start / resubmit record)."""
    return next((r["time"] for r in reversed(records) if r.get("kind") in ("start", "resubmit")
                 and r.get("details", {}).get("handle") == handle), 0.0)


def allocation_never_started(records: list[dict[str, Any]], last: dict[str, Any]) -> bool:
    """Pure: a Slurm allocation (`last`: its start / resubmit details) whose supervisor wrote no `allocation` record:
    the job ended (launch failure, cancelled while pending, ...) before anything of the run ran in it."""
    return last["cluster"] == "slurm" and not any(
        r.get("kind") == "allocation" and r["details"].get("job_id") == last["handle"] for r in records)
