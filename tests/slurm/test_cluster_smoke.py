"""The local Slurm test cluster behaves like a small real one: distinct node names, accounting, submitit, node lists,
and node failures that the helpers can cause and undo."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from slurm.helpers import (
    cluster_script,
    kill_node,
    node_states,
    restore_nodes,
    run_cmd,
    start_node,
    stop_slurmd,
    wait_idle,
    wait_not_responding,
    wait_sacct_state,
)

from moe_launch.rundir import node_name

pytestmark = pytest.mark.slurm
JOB_NAME = "smoke-node-fault"


def test_srun_runs_on_distinct_nodes_whose_hostnames_differ_from_their_names(slurm_cluster):
    """Like many real clusters, a node's hostname (node3.hpc.example) is not its Slurm NodeName (node3); node_name()
    gives the NodeName, which is what the allocation's node lists hold."""
    code = "from moe_launch.rundir import node_name; import socket; print(node_name(), socket.gethostname())"
    out = run_cmd(["srun", "-N", "3", "--immediate=60", sys.executable, "-c", code], timeout=90).stdout
    pairs = [line.split() for line in out.splitlines()]
    names, hosts = [p[0] for p in pairs], [p[1] for p in pairs]
    assert len(set(names)) == 3 and set(names) <= set(slurm_cluster.nodes), out
    assert hosts == [f"{n}.hpc.example" for n in names], out


def test_sbatch_job_is_completed_in_sacct(slurm_cluster, tmp_path):
    job_id = run_cmd(
        ["sbatch", "--parsable", "-N", "1", f"--output={tmp_path}/%j.out", "--wrap", "echo hello-from-$(hostname)"],
        timeout=30,
    ).stdout.strip().split(";")[0]
    assert wait_sacct_state(job_id, {"COMPLETED"}, timeout=60) == "COMPLETED"
    assert (tmp_path / f"{job_id}.out").read_text().startswith("hello-from-node")


def test_submitit_job_returns_its_hostname(slurm_cluster, tmp_path):
    submitit = pytest.importorskip("submitit")
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=5, nodes=1, tasks_per_node=1, cpus_per_task=1)
    job = executor.submit(node_name)
    assert job.result() in slurm_cluster.nodes
    # submitit reads job states from sacct: with accounting on it must reach COMPLETED, not UNKNOWN
    deadline = time.monotonic() + 30
    while job.state != "COMPLETED" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job.state == "COMPLETED"


def test_scontrol_expands_node_lists(slurm_cluster):
    out = run_cmd(["scontrol", "show", "hostnames", "node[1-3]"], timeout=15).stdout.split()
    assert out == ["node1", "node2", "node3"]
    assert socket.gethostbyname("node3") == "127.0.100.3"


def _task_alive(node: str, marker: str) -> bool:
    # the step's task is `/usr/bin/sleep <marker>`; the marker makes the command line unique to this test
    return subprocess.run(["pgrep", "-f", f"^(/usr)?(/bin/)?sleep {marker}$"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_kill_node_and_stop_slurmd(slurm_cluster, tmp_path):
    """kill-node ends the node's tasks and the node goes down; stop-slurmd leaves the tasks; start-node heals both."""
    node = slurm_cluster.idle_nodes[-1]
    step = None
    try:
        # hard kill: the running task dies with its slurmstepd
        marker = "301.5"
        step = subprocess.Popen(
            ["srun", "-N", "1", f"--nodelist={node}", "--immediate=30", f"--job-name={JOB_NAME}", "sleep", marker],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_for(lambda: _task_alive(node, marker), 30, "the srun task to start")
        kill_node(node)
        assert not _task_alive(node, marker)
        wait_not_responding([node], timeout=60)
        step.wait(timeout=60)
        start_node(node)
        wait_idle([node], timeout=60)

        # slurmd only: the task outlives its slurmd
        marker = "302.5"
        step = subprocess.Popen(
            ["srun", "-N", "1", f"--nodelist={node}", "--immediate=30", f"--job-name={JOB_NAME}", "sleep", marker],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_for(lambda: _task_alive(node, marker), 30, "the srun task to start")
        stop_slurmd(node)
        wait_not_responding([node], timeout=60)
        assert _task_alive(node, marker)
        step.kill()
        step.wait(timeout=30)
    finally:
        if step is not None:
            step.kill()
            step.wait(timeout=30)
        run_cmd(["scancel", f"--name={JOB_NAME}"], check=False)
        restore_nodes([node], timeout=90)
    assert node_states()[node] == "idle"
    # once the slurmd is back, Slurm itself ends the orphaned step of the failed job
    _wait_for(lambda: not _task_alive(node, marker), 60, "the orphaned task to be cleaned up")


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def test_cluster_script_lifecycle(slurm_cluster):
    """A second, private 2-node cluster (own dir and ports, no accounting): `up` is idempotent, job ids continue
    across down/up, and `down` leaves no daemon and no /etc/hosts block behind. The shared cluster is untouched."""
    # not under tmp_path: munged rejects a socket whose parent dirs are not world-searchable (pytest's are 0700)
    state_dir = Path(tempfile.mkdtemp(prefix="moe-slurm-lifecycle-", dir="/tmp"))
    os.chmod(state_dir, 0o755)
    env = {
        **os.environ,
        "MOE_SLURM_DIR": str(state_dir),
        "MOE_SLURM_PORT_BASE": str(18800 + os.getpid() % 50 * 200),
        "MOE_SLURM_ACCOUNTING": "0",
        "SLURM_CONF": str(state_dir / "etc" / "slurm.conf"),
    }

    def cluster(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["bash", str(cluster_script()), *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert (proc.returncode == 0) == ok, f"cluster.sh {' '.join(args)}: rc={proc.returncode}\n{proc.stderr}"
        return proc

    def sbatch_id() -> int:
        out = subprocess.run(["sbatch", "--parsable", "--wrap", "true"], env=env, capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return int(out.strip().split(";")[0])

    try:
        cluster("up", "2")
        assert "already up" in cluster("up", "2").stderr
        first = sbatch_id()
        cluster("down")
        cluster("status", ok=False)
        assert str(state_dir) not in Path("/etc/hosts").read_text()
        cluster("up", "2")
        assert sbatch_id() > first
    finally:
        cluster("down")
        shutil.rmtree(state_dir, ignore_errors=True)
        Path(f"{state_dir}.next-jobid").unlink(missing_ok=True)
    leftovers = subprocess.run(["pgrep", "-f", str(state_dir) + "/"], capture_output=True, text=True).stdout.split()
    assert leftovers == []
