"""Running health tasks on nodes, through the orchestrator's launchers.

cluster.kind == "slurm": `srun` with --nodelist (a step of the current allocation when SLURM_JOB_ID is set, else a
  short allocation of its own; `--immediate` so a down or busy node fails fast instead of pending forever). The argv
  comes from orchestrator/srun.py, the one srun builder that also starts the trainer step and the node probes.
cluster.kind == "local": nodes are names (local1..localN); their tasks are started by the local cluster's launcher
  (orchestrator/local_cluster.LocalStep, the one that runs the trainer): MOE_LAUNCH_NODE=<name>, rank environment,
  kill-on-bad-exit. Nodes that share a GPU run their per-node checks one after another (local_gpus.py).

`health_srun_argv` is pure (health's choices: job name, --immediate, a time limit from the timeout) and unit-tested;
`run_per_node` and `run_ranks` are the thin side-effecting wrappers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_launch.conf.schema import ClusterConfig
from moe_launch.orchestrator.backend import Step, free_port
from moe_launch.orchestrator.local_gpus import preflight_waves, visible_gpus
from moe_launch.orchestrator.srun import NewAllocation, srun_argv


@dataclass
class TaskOutcome:
    name: str  # node, or "+".join(nodes) for a multi-node run
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def tail(self, n: int = 400) -> str:
        return (self.stderr.strip() or self.stdout.strip())[-n:]


def python_exe(cluster: ClusterConfig) -> str:
    return cluster.python or sys.executable


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def health_srun_argv(cluster: ClusterConfig, nodes: list[str], tasks_per_node: int, timeout_s: float,
                     inside_allocation: bool) -> list[str]:
    """Pure: the srun prefix (orchestrator/srun.py) that runs `tasks_per_node` health tasks on each of `nodes`.
    Inside an allocation a step of it (--overlap: health steps never queue behind a running step of the same
    allocation); outside, a short allocation of its own that gives up after 30 s on a down or busy node."""
    own = None if inside_allocation else NewAllocation(
        time_min=max(1, int(timeout_s // 60) + 1), immediate_s=30,
        partition=cluster.partition, account=cluster.account, qos=cluster.qos)
    return srun_argv(nodes, tasks_per_node, "moe-health", overlap=inside_allocation, new_allocation=own,
                     cpus_per_task=cluster.cpus_per_task, gpus_per_node=cluster.gpus_per_node,
                     kill_on_bad_exit=True, export_all=True)


class _Task:
    """A started process whose output goes to temporary files (pipes could fill up while we poll)."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self.out, stderr=self.err, text=True,
                                     start_new_session=True)  # own process group: a timeout ends this task tree

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def wait(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def outcome(self, name: str, timed_out: bool) -> TaskOutcome:
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        rc = self.proc.returncode if self.proc.returncode is not None else -9
        return TaskOutcome(name, rc, texts[0], texts[1], timed_out)


def _start(argv: list[str], env: dict[str, str]) -> _Task:
    return _Task(argv, env)


def _stop(task: _Task) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(task.proc.pid, sig)
        except ProcessLookupError:
            return
        if task.wait(5.0) is not None:
            return


def _collect(tasks: dict[str, _Task], timeout_s: float) -> dict[str, TaskOutcome]:
    deadline = time.monotonic() + timeout_s
    out: dict[str, TaskOutcome] = {}
    for name, task in tasks.items():
        timed_out = task.wait(max(deadline - time.monotonic(), 0.1)) is None
        if timed_out:
            _stop(task)
        out[name] = task.outcome(name, timed_out)
    return out


def run_per_node(nodes: list[str], argv: list[str], cluster: ClusterConfig, timeout_s: float,
                 env: Optional[dict[str, str]] = None) -> dict[str, TaskOutcome]:
    """One task per node, all nodes in parallel, each in its own srun (a dead node fails only its own task)."""
    env = dict(env or {})
    if cluster.kind == "slurm":
        inside = in_allocation()
        procs = {node: _start(health_srun_argv(cluster, [node], 1, timeout_s, inside) + argv, env) for node in nodes}
        return _collect(procs, timeout_s)
    # local "nodes" share this machine's GPUs: nodes that share one are checked one after another
    out: dict[str, TaskOutcome] = {}
    for wave in preflight_waves(nodes, visible_gpus(), cluster.tasks_per_node):
        steps = {}
        for node, devices in wave.items():
            gpu_env = {"CUDA_VISIBLE_DEVICES": devices} if devices else {}
            steps[node] = _local_step((node,), 1, argv, {**env, **gpu_env})
        deadline = time.monotonic() + timeout_s
        out.update({node: _finish_local(node, *started, deadline) for node, started in steps.items()})
    return out


def run_ranks(nodes: list[str], tasks_per_node: int, argv: list[str], cluster: ClusterConfig, timeout_s: float,
              env: Optional[dict[str, str]] = None) -> TaskOutcome:
    """`tasks_per_node` ranks on each node, one torch.distributed world (rank order: node by node)."""
    env = dict(env or {})
    name = "+".join(nodes)
    port = free_port()
    if cluster.kind == "slurm":
        prefix = health_srun_argv(cluster, nodes, tasks_per_node, timeout_s, in_allocation())
        env.update(MASTER_ADDR=nodes[0], MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        return _collect({name: _start(prefix + argv, env)}, timeout_s)[name]
    step, logs = _local_step(tuple(nodes), tasks_per_node, argv, {**env, "MASTER_PORT": str(port)})
    return _finish_local(name, step, logs, time.monotonic() + timeout_s)


def _local_step(nodes: tuple[str, ...], tasks_per_node: int, argv: list[str], env: dict[str, str]) -> tuple[Step, Path]:
    """Start the ranks with the local cluster's launcher; their output goes to a temporary log directory."""
    from moe_launch.orchestrator.local_cluster import LocalStep

    logs = Path(tempfile.mkdtemp(prefix="moe-health-"))
    env = {**env, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    return LocalStep(nodes, 0, argv, env, tasks_per_node, logs), logs


def _finish_local(name: str, step: Step, logs: Path, deadline: float) -> TaskOutcome:
    """Wait for the step (a bad exit ends the other ranks, like srun --kill-on-bad-exit), or end it at the deadline."""
    result = step.poll()
    while result is None and time.monotonic() < deadline:
        time.sleep(0.05)
        result = step.poll()
    timed_out = result is None
    if timed_out:
        step.kill()
        step.wait(10.0)
        result = step.poll()
    text = "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")))
    shutil.rmtree(logs, ignore_errors=True)
    return TaskOutcome(name, result.code if result is not None else -9, text, "", timed_out)
