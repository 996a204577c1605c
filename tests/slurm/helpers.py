"""Thin Python wrappers around tests/slurm/cluster.sh and the Slurm CLI, for tests that fail nodes on purpose.

Import from any test as `from slurm.helpers import kill_node, node_states, ...` (tests/ is on sys.path through
tests/conftest.py). Every call uses an argument list (no shell) and a timeout. Node states are the lowercase words of
`sinfo -N -h -o '%N %T'`, where a trailing '*' means "not responding", e.g. "idle", "allocated", "mixed", "down*",
"idle*", "drained".
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

STATE_DIR = Path(os.environ.get("MOE_SLURM_DIR", "/tmp/moe-launch-slurm"))
SLURM_CONF = STATE_DIR / "etc" / "slurm.conf"
# A node counts as usable when it is in one of these states (no '*': it answers pings).
USABLE_STATES = frozenset({"idle", "mixed", "allocated", "completing"})


@dataclass(frozen=True)
class ClusterInfo:
    """What the `slurm_cluster` fixture hands to a test."""

    nodes: tuple[str, ...]  # every node the controller knows, e.g. ("node1", ..., "node6")
    idle_nodes: tuple[str, ...]  # those idle when the fixture checked
    slurm_conf: Path
    state_dir: Path


def cluster_script() -> Path:
    return Path(__file__).resolve().parent / "cluster.sh"


def _slurm_env() -> dict[str, str]:
    # /etc/slurm/slurm.conf normally links to our conf; SLURM_CONF also covers a machine where it cannot.
    env = dict(os.environ)
    env.setdefault("SLURM_CONF", str(SLURM_CONF))
    return env


def run_cmd(args: list[str], timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command with the cluster's SLURM_CONF; on failure raise with its stderr in the message."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_slurm_env())
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _cluster(command: str, *args: str, timeout: float = 120.0) -> None:
    run_cmd(["bash", str(cluster_script()), command, *args], timeout=timeout)


def kill_node(name: str) -> None:
    """Hard failure: SIGKILL the node's slurmd, its slurmstepds and their task trees."""
    _cluster("kill-node", name)


def start_node(name: str) -> None:
    """(Re)start the node's slurmd; a no-op if it runs. A node DOWN for not responding returns to idle by itself."""
    _cluster("start-node", name)


def stop_slurmd(name: str) -> None:
    """Kill only the node's slurmd: its tasks keep running, the node goes not-responding, then DOWN."""
    _cluster("stop-slurmd", name)


def resume_node(name: str) -> None:
    """scontrol update state=resume: undo an admin DOWN or DRAIN."""
    _cluster("resume-node", name)


def stop_controller() -> None:
    """Stop slurmctld (its state is saved; running jobs and steps go on): a controller outage."""
    _cluster("stop-controller")


def start_controller() -> None:
    """Start slurmctld again from its saved state."""
    _cluster("start-controller")


def controller_up() -> bool:
    try:
        return "is UP" in run_cmd(["scontrol", "ping"], timeout=15, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


def node_states() -> dict[str, str]:
    """{node name: state} from `sinfo -N -h -o '%N %T'` (a node in several partitions is listed once)."""
    out = run_cmd(["sinfo", "-N", "-h", "-o", "%N %T"], timeout=30).stdout
    states: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1].lower()
    return states


def wait_states(
    names: Iterable[str], accept: Callable[[str], bool], timeout: float, what: str = "the wanted state"
) -> dict[str, str]:
    """Poll node_states() until accept(state) holds for every named node; return the states or raise TimeoutError."""
    wanted = list(names)
    deadline = time.monotonic() + timeout
    while True:
        states = node_states()
        if all(accept(states.get(n, "unknown")) for n in wanted):
            return states
        if time.monotonic() > deadline:
            shown = {n: states.get(n, "unknown") for n in wanted}
            raise TimeoutError(f"nodes did not reach {what} within {timeout:.0f}s: {shown}")
        time.sleep(0.5)


def wait_idle(names: Iterable[str], timeout: float = 60.0) -> dict[str, str]:
    """Wait until every named node is plain 'idle' ('idle*' right after a resume does not count)."""
    return wait_states(names, lambda s: s == "idle", timeout, "idle")


def wait_not_responding(names: Iterable[str], timeout: float = 60.0) -> dict[str, str]:
    """Wait until the controller marks the nodes not responding ('*' suffix) or DOWN."""
    return wait_states(names, lambda s: s.endswith("*") or s.startswith("down"), timeout, "not responding/down")


def restore_nodes(names: Iterable[str], timeout: float = 60.0) -> None:
    """Bring nodes back after a fault test: start dead slurmds, resume admin DOWN/DRAIN, wait for idle."""
    names = list(names)
    for name in names:
        start_node(name)
    states = node_states()
    for name in names:
        if states.get(name, "").rstrip("*").startswith(("down", "drain")):
            resume_node(name)
    wait_idle(names, timeout)


def sacct_state(job_id: str | int) -> str:
    """The job-level State in sacct ('' if sacct has no row yet; it lags the job by a few seconds)."""
    out = run_cmd(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,State"], timeout=30).stdout
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        if jid.strip() == str(job_id):
            return state.split()[0] if state.strip() else ""
    return ""


def wait_sacct_state(job_id: str | int, states: Iterable[str], timeout: float = 60.0) -> str:
    """Poll sacct until the job reaches one of `states` (e.g. {"COMPLETED"}); return it or raise TimeoutError."""
    wanted = set(states)
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        last = sacct_state(job_id)
        if last in wanted:
            return last
        time.sleep(0.5)
    raise TimeoutError(f"sacct job {job_id}: state {last or 'no row'} after {timeout:.0f}s, wanted {sorted(wanted)}")
