"""The one builder of `srun` command lines: every task that moe-launch runs on Slurm nodes starts with its prefix.

Three callers, each with its own policy, one set of flags:
  slurm.step_argv         the trainer step: a step of the allocation (--jobid, --overlap), tasks_per_node ranks a node
  slurm.probe_argv        a trivial step on one node, asked whether the node still starts tasks
  health.exec             preflight tasks: a step of the current allocation, or a short allocation of their own

Pure: no environment is read here; the caller passes what it decided (job id, overlap, time limit, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class NewAllocation:
    """What srun asks of the scheduler when its tasks are not a step of an existing allocation."""

    time_min: int
    immediate_s: int = 0  # > 0: give up after this long instead of pending (a down or busy node fails fast)
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None


def srun_argv(nodes: Sequence[str], tasks_per_node: int, job_name: str, *,
              job_id: Optional[str] = None, overlap: bool = False, new_allocation: Optional[NewAllocation] = None,
              cpus_per_task: Optional[int] = None, gpus_per_node: int = 0, kill_on_bad_exit: bool = False,
              export_all: bool = False) -> list[str]:
    """The srun prefix that runs `tasks_per_node` tasks on each of `nodes`; the program's argv follows it.

    job_id: a step of that job (None: of $SLURM_JOB_ID's job inside an allocation, else a new allocation).
    overlap: the step shares the allocation's resources with running steps instead of queueing behind them.
    new_allocation: srun allocates nodes of its own (not with job_id or overlap, which name a step).
    cpus_per_task (None), gpus_per_node (0): left to Slurm's defaults.
    """
    if not nodes or tasks_per_node < 1:
        raise ValueError(f"srun needs at least one node and one task per node, got {list(nodes)} x {tasks_per_node}")
    if new_allocation is not None and (job_id is not None or overlap):
        raise ValueError("srun_argv: new_allocation asks for nodes of its own; job_id/overlap name a step of a job")
    argv = ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * tasks_per_node}",
            f"--ntasks-per-node={tasks_per_node}", f"--nodelist={','.join(nodes)}"]
    if cpus_per_task is not None:
        argv.append(f"--cpus-per-task={cpus_per_task}")
    if kill_on_bad_exit:
        argv.append("--kill-on-bad-exit=1")
    argv.append(f"--job-name={job_name}")
    if export_all:
        argv.append("--export=ALL")
    if job_id is not None:
        argv.append(f"--jobid={job_id}")
    if overlap:
        argv.append("--overlap")
    if new_allocation is not None:
        a = new_allocation
        if a.immediate_s:
            argv.append(f"--immediate={a.immediate_s}")
        argv.append(f"--time={a.time_min}")
        argv += [f"--{key}={value}" for key, value in (("partition", a.partition), ("account", a.account),
                                                       ("qos", a.qos)) if value]
    if gpus_per_node:
        argv.append(f"--gpus-per-node={gpus_per_node}")
    return argv
