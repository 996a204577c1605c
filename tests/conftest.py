"""Fixtures shared by the whole suite.

* `slurm_cluster` (session): the local Slurm test cluster of tests/slurm/cluster.sh, started if none runs.
  Tests that need it are marked `@pytest.mark.slurm` and take the fixture. Without a cluster they are skipped with the
  reason, except in CI (CI=true), where a missing cluster fails the run instead of passing silently.
* `tmp_run_dir`: a fresh, made run directory (moe_launch.rundir.RunDir) under tmp_path.
* autouse: OMP_NUM_THREADS=1 (the CI machine has 2 cores shared by every process of the suite).
* The host's GPUs are hidden from the suite's processes (tests/helpers_gpu.py); GPU tests run scripts in children.
* `free_port()` lives in tests/helpers_net.py; it is re-exported here as a fixture-free import for convenience.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:  # so `from slurm.helpers import ...` and `from helpers_net import ...` work
    sys.path.insert(0, str(TESTS_DIR))

from helpers_gpu import hide_host_gpus  # noqa: E402

# Before CUDA can be initialised: the suite runs the CPU paths on every host (helpers_gpu.py says why).
hide_host_gpus()

# Triton picks compiled or interpreted once, at its first import; torch._dynamo (a compile test) imports it too. On a
# host without CUDA the kernels' package asks for the interpreter when it comes first, so it comes first here: which
# test a worker happens to run first must not decide whether the kernels can run at all.
import moe_launch.kernels  # noqa: E402,F401

# The suite's health history, quarantine list and all-to-all baselines live in a directory of its own (the config's
# defaults follow XDG_DATA_HOME / XDG_CONFIG_HOME): nodes blamed by one test run must not be quarantined for the
# user's real runs, nor for the next test session on the same machine. Set once; xdist workers inherit it.
if "MOE_TEST_STATE_HOME" not in os.environ:
    os.environ["MOE_TEST_STATE_HOME"] = tempfile.mkdtemp(prefix="moe-launch-test-state-")
    os.environ["XDG_DATA_HOME"] = os.path.join(os.environ["MOE_TEST_STATE_HOME"], "data")
    os.environ["XDG_CONFIG_HOME"] = os.path.join(os.environ["MOE_TEST_STATE_HOME"], "config")

from helpers_net import free_port  # noqa: E402,F401  (re-export)
from slurm import helpers as slurm_helpers  # noqa: E402

from moe_launch.rundir import RunDir  # noqa: E402

MIN_IDLE_NODES = 4
# Serialises "is a cluster up? if not, start one" across pytest-xdist workers and parallel pytest runs.
CLUSTER_LOCK = Path("/tmp/moe-launch-slurm.lock")
# Up from scratch is ~20 s when packages are installed, about a minute more when apt has to fetch them.
UP_TIMEOUT_S = 900
IDLE_WAIT_S = 90


@pytest.fixture(autouse=True)
def _one_thread_per_process(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")


@pytest.fixture
def tmp_run_dir(tmp_path) -> RunDir:
    return RunDir(tmp_path / "run").make()


def _idle(states: dict[str, str]) -> list[str]:
    return sorted(n for n, s in states.items() if s == "idle")


def _ensure_cluster() -> tuple[slurm_helpers.ClusterInfo | None, str]:
    """Return (info, "") for a usable cluster, else (None, why). Starts one only if no controller answers."""
    if shutil.which("sinfo") is None and os.geteuid() != 0:
        return None, "Slurm is not installed and installing it needs root (run: sudo bash tests/slurm/cluster.sh up 6)"
    log = ""
    with open(CLUSTER_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if shutil.which("sinfo") is None or not slurm_helpers.controller_up():
            proc = subprocess.run(
                ["bash", str(slurm_helpers.cluster_script()), "up", "6"],
                capture_output=True, text=True, timeout=UP_TIMEOUT_S,
            )
            log = (proc.stdout + proc.stderr)[-2000:]
            if proc.returncode != 0:
                return None, f"`tests/slurm/cluster.sh up 6` failed (exit {proc.returncode}):\n{log}"
        if not slurm_helpers.controller_up():
            return None, f"slurmctld does not answer `scontrol ping` after `cluster.sh up 6`:\n{log}"
        states = slurm_helpers.node_states()
    # Other tests (or other engineers) may hold nodes for a while; wait for them rather than restarting anything.
    # Dead nodes are not revived here either: a fault test in another xdist worker may have killed one on purpose.
    deadline = time.monotonic() + IDLE_WAIT_S
    while len(_idle(states)) < MIN_IDLE_NODES and time.monotonic() < deadline:
        time.sleep(1.0)
        states = slurm_helpers.node_states()
    if len(_idle(states)) < MIN_IDLE_NODES:
        return None, (
            f"fewer than {MIN_IDLE_NODES} idle Slurm nodes after {IDLE_WAIT_S}s: {states}; revive a node with "
            "`bash tests/slurm/cluster.sh start-node NODE` or `resume-node NODE`"
        )
    info = slurm_helpers.ClusterInfo(
        nodes=tuple(sorted(states, key=lambda n: (len(n), n))),
        idle_nodes=tuple(_idle(states)),
        slurm_conf=slurm_helpers.SLURM_CONF,
        state_dir=slurm_helpers.STATE_DIR,
    )
    return info, ""


@pytest.fixture(scope="session")
def slurm_cluster() -> slurm_helpers.ClusterInfo:
    info, why = _ensure_cluster()
    if info is None:
        message = f"NO LOCAL SLURM CLUSTER: {why}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return info
