"""cluster.kind=local: "nodes" local1..local(N+B) are groups of processes on this machine.

Each node runs cluster.tasks_per_node trainer processes with MOE_LAUNCH_NODE=<node>, RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1 and MASTER_PORT, in its own process group. Failing a node = killing its processes: the step
then reports that node dead, exactly like a Slurm node failure, so the same supervisor and decide() run unchanged.
Like `srun --kill-on-bad-exit=1`, the first bad exit ends the other tasks. On a machine with GPUs each node of a step
sees its own GPUs through CUDA_VISIBLE_DEVICES (local_gpus.py), as a Slurm node sees only its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from moe_launch.orchestrator.backend import StepResult
from moe_launch.orchestrator.local_gpus import step_devices, visible_gpus

# SLURM_* variables of an enclosing job must not make the trainer think srun launched it
_DROP_ENV_PREFIXES = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_")


class LocalStep:
    def __init__(self, nodes: tuple[str, ...], attempt: int, argv: list[str], env: dict[str, str],
                 tasks_per_node: int, log_dir: Path, gpus: tuple[str, ...] = ()):
        self.nodes, self.attempt = nodes, attempt
        world = len(nodes) * tasks_per_node
        base = {k: v for k, v in os.environ.items() if not k.startswith(_DROP_ENV_PREFIXES)}
        base.update(env)
        # every rank shares this machine's CPUs: torch's default (all cores per process) oversubscribes them, and
        # spinning OpenMP threads then stall the gloo collectives for seconds (make run: 3 min -> 32 s with this)
        base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[tuple[str, int, subprocess.Popen]] = []
        self.killed_by_us: set[int] = set()
        self.first_bad: Optional[tuple[str, int]] = None  # (node, returncode) of the first bad exit
        devices = step_devices(nodes, gpus, tasks_per_node)
        for i, node in enumerate(nodes):
            for local in range(tasks_per_node):
                rank = i * tasks_per_node + local
                penv = {**base, "MOE_LAUNCH_NODE": node, "RANK": str(rank), "WORLD_SIZE": str(world),
                        "LOCAL_RANK": str(local)}
                if devices:
                    penv["CUDA_VISIBLE_DEVICES"] = devices[node]
                with open(log_dir / f"{node}-rank{rank}.log", "ab") as log:
                    proc = subprocess.Popen(argv, env=penv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
                self.procs.append((node, rank, proc))

    def poll(self) -> Optional[StepResult]:
        codes = [(node, proc.poll(), proc) for node, _, proc in self.procs]
        if self.first_bad is None:
            for node, rc, proc in codes:
                if rc not in (None, 0) and proc.pid not in self.killed_by_us:
                    self.first_bad = (node, rc)
                    self.kill()  # --kill-on-bad-exit
                    break
        if any(rc is None for _, rc, _ in codes):
            return None
        if self.first_bad is None:
            return StepResult(code=0)
        # a task killed by a signal we did not send means its node "failed"; others just exited non-zero
        dead = tuple(dict.fromkeys(n for n, rc, p in codes if rc < 0 and p.pid not in self.killed_by_us))
        failed = tuple(dict.fromkeys(n for n, rc, p in codes if rc > 0))
        node, rc = self.first_bad
        code = rc if rc > 0 else 128 - rc
        what = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        killed = f"; tasks killed on {', '.join(dead)}" if dead else ""
        return StepResult(code=code, dead_nodes=dead, failed_nodes=failed,
                          detail=f"first bad exit: {node} ({what}){killed}")

    def terminate(self, signal_name: str = "USR2") -> None:
        sig = getattr(signal, f"SIG{signal_name}")
        for _, _, proc in self.procs:
            if proc.poll() is None:
                self._signal(proc, sig)

    def kill(self) -> None:
        for _, _, proc in self.procs:
            if proc.poll() is None:
                self.killed_by_us.add(proc.pid)
                self._signal(proc, signal.SIGKILL)

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(p.poll() is not None for _, _, p in self.procs):
                return True
            time.sleep(0.05)
        return False

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the task and anything it started (own session)
        except ProcessLookupError:
            pass


class LocalCluster:
    kind = "local"

    def __init__(self, nodes: tuple[str, ...], tasks_per_node: int, gpus: Optional[tuple[str, ...]] = None):
        self.nodes, self.tasks_per_node = nodes, tasks_per_node
        self.gpus = visible_gpus() if gpus is None else gpus

    def allocation(self) -> tuple[str, ...]:
        return self.nodes

    def probe(self, nodes: tuple[str, ...]) -> set[str]:
        return set(nodes)  # process groups on this machine: there is no node to lose

    def unavailable(self, nodes: tuple[str, ...]) -> dict[str, str]:
        return {}  # a local "node" only fails through its processes, which its step reports

    def launch(self, nodes: tuple[str, ...], attempt: int, argv: list[str], env: dict[str, str],
               log_dir: Path) -> LocalStep:
        return LocalStep(nodes, attempt, argv, {**env, "MASTER_ADDR": "127.0.0.1"}, self.tasks_per_node, log_dir,
                         self.gpus)

    def master_addr(self, nodes: tuple[str, ...]) -> str:
        return "127.0.0.1"
