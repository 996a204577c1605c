"""The launch plan: pure `plan(cfg, partition, quarantined) -> LaunchPlan`.

Everything the login side will do is decided here, from the typed config and what the scheduler said about the
partition (gathered by slurm.py, or None for cluster.kind=local). `--dry-run` prints this plan and the script
`render_sbatch` makes of it; a real launch submits exactly that. Impossible requests fail here, before any
submission, with a ConfigError naming the key. Each allocation's plan is written to the run directory
(`plan.json`, `write_plan`); the supervisor reads it (`read_plan`) instead of deriving nodes or commands again.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Optional

from moe_launch.conf.schema import RootConfig
from moe_launch.errors import ConfigError, SubmissionError
from moe_launch.rundir import write_json_atomic

PLAN_FILE = "plan.json"

# characters that neither a shell word nor an #SBATCH line can carry safely, even quoted
_UNSAFE = ("\n", "\r", "\0", "\\")


@dataclass(frozen=True)
class PartitionInfo:
    """What `sinfo` reports about the partition (slurm.py builds it; tests build it by hand)."""

    name: str
    nodes: tuple[str, ...]  # every node of the partition, expanded (scontrol show hostnames)
    unavailable: tuple[str, ...] = ()  # down / drained / not responding now
    max_time_min: Optional[int] = None  # None: unlimited


@dataclass(frozen=True)
class LaunchPlan:
    kind: str  # local | slurm
    run_name: str
    run_dir: str  # absolute
    nodes: int  # N
    buffers: int  # B
    tasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int
    mem_per_node_mb: int
    time_limit_min: int
    signal_before_end_s: int
    partition: Optional[str]
    account: Optional[str]
    qos: Optional[str]
    exclude: tuple[str, ...]  # cluster.exclude (known) + quarantined nodes
    extra_sbatch: tuple[str, ...]
    python: str
    supervisor_argv: tuple[str, ...]
    trainer_argv: tuple[str, ...]  # `--attempt K` is appended per launch
    local_nodes: tuple[str, ...] = ()  # cluster.kind=local: local1..local(N+B)
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.buffers

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "LaunchPlan":
        tuples = {f.name for f in fields(LaunchPlan) if str(f.type).startswith("tuple")}
        return LaunchPlan(**{k: tuple(v) if k in tuples else v for k, v in d.items()
                             if k in {f.name for f in fields(LaunchPlan)}})


def write_plan(p: LaunchPlan, run_dir: Path) -> Path:
    path = Path(run_dir) / PLAN_FILE
    write_json_atomic(path, p.to_json())
    return path


def read_plan(run_dir: Path) -> LaunchPlan:
    path = Path(run_dir) / PLAN_FILE
    try:
        return LaunchPlan.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise SubmissionError(f"{path} cannot be read ({e}); start runs with moe-launch, which writes it") from e


def plan(cfg: RootConfig, partition: Optional[PartitionInfo] = None, quarantined: Iterable[str] = (),
         run_dir: Optional[str] = None) -> LaunchPlan:
    c = cfg.cluster
    run_dir = str(Path(run_dir or Path(cfg.run.root) / cfg.run.name).absolute())
    python = c.python or sys.executable
    for key, value in (("run.name", cfg.run.name), ("cluster.partition", c.partition), ("cluster.account", c.account),
                       ("cluster.qos", c.qos), ("cluster.python", python), ("run.root", run_dir)):
        _check_safe(key, value)
    for i, value in enumerate(c.extra_sbatch):
        _check_safe(f"cluster.extra_sbatch[{i}]", value)
    for i, value in enumerate(c.exclude):
        _check_safe(f"cluster.exclude[{i}]", value)
    warnings: list[str] = []
    quarantined = tuple(sorted(set(quarantined)))
    exclude = tuple(dict.fromkeys(list(c.exclude) + list(quarantined)))
    local_nodes: tuple[str, ...] = ()
    if c.kind == "local":
        local_nodes = tuple(f"local{i}" for i in range(1, c.nodes + c.buffers + 1))
        if c.exclude:
            warnings.append(f"cluster.exclude={list(c.exclude)} is ignored with cluster.kind=local")
        exclude = ()
    else:
        exclude = _check_partition(cfg, partition, exclude, quarantined, warnings)
    if c.kind == "slurm" and c.time_limit_min * 60 <= c.signal_before_end_s:
        raise ConfigError("cluster.time_limit_min", f"{c.time_limit_min} min leaves no time before the checkpoint "
                          f"signal sent cluster.signal_before_end_s={c.signal_before_end_s} s before the end",
                          "raise cluster.time_limit_min or lower cluster.signal_before_end_s")
    supervisor = (python, "-m", "moe_launch.orchestrator.supervisor", "--run-dir", run_dir)
    trainer = trainer_argv(cfg, run_dir)
    return LaunchPlan(
        kind=c.kind, run_name=cfg.run.name, run_dir=run_dir, nodes=c.nodes, buffers=c.buffers,
        tasks_per_node=c.tasks_per_node, cpus_per_task=c.cpus_per_task, gpus_per_node=c.gpus_per_node,
        mem_per_node_mb=c.mem_per_node_mb, time_limit_min=c.time_limit_min, signal_before_end_s=c.signal_before_end_s,
        partition=partition.name if partition else c.partition, account=c.account, qos=c.qos, exclude=exclude,
        extra_sbatch=tuple(c.extra_sbatch), python=python, supervisor_argv=supervisor, trainer_argv=trainer,
        local_nodes=local_nodes, warnings=tuple(warnings),
    )


def trainer_argv(cfg: RootConfig, run_dir: str) -> tuple[str, ...]:
    """The trainer's command line without `--attempt K` (the supervisor appends it per launch)."""
    cmd = tuple(cfg.supervisor.trainer_command) or (cfg.cluster.python or sys.executable, "-m", "moe_launch.trainer")
    return cmd + ("--run-dir", run_dir)


def _check_partition(cfg: RootConfig, part: Optional[PartitionInfo], exclude: tuple[str, ...],
                     quarantined: tuple[str, ...], warnings: list[str]) -> tuple[str, ...]:
    c = cfg.cluster
    if part is None:
        raise ConfigError("cluster.partition", f"partition {c.partition or '(default)'} does not exist",
                          "pick one that `sinfo -s` lists, or leave cluster.partition unset for the default")
    unknown = [n for n in c.exclude if n not in part.nodes]
    if unknown:  # a typo would otherwise let the node the user meant to avoid into the job
        shown = ", ".join(part.nodes[:8]) + (", ..." if len(part.nodes) > 8 else "")
        raise ConfigError("cluster.exclude", f"node(s) not in partition {part.name}: {', '.join(unknown)}",
                          f"check the spelling; the partition's nodes are {shown}")
    exclude = tuple(n for n in exclude if n in part.nodes)
    usable = [n for n in part.nodes if n not in exclude and n not in part.unavailable]
    want = c.nodes + c.buffers
    if want > len(part.nodes) - len(exclude):
        raise ConfigError(
            "cluster.nodes", f"cluster.nodes + cluster.buffers = {c.nodes} + {c.buffers} = {want} but partition "
            f"{part.name} has {len(part.nodes)} node(s), {len(exclude)} excluded/quarantined",
            "lower cluster.nodes or cluster.buffers, or use a larger partition")
    if want > len(usable):
        warnings.append(f"only {len(usable)} of {len(part.nodes)} nodes of {part.name} are up; the job will pend "
                        f"until {want} are available")
    if quarantined:
        warnings.append(f"quarantined by moe-health (excluded): {', '.join(quarantined)}")
    if part.max_time_min is not None and c.time_limit_min > part.max_time_min:
        raise ConfigError("cluster.time_limit_min", f"{c.time_limit_min} min exceeds partition {part.name}'s "
                          f"limit of {part.max_time_min} min", f"use at most {part.max_time_min}")
    return exclude


def _check_safe(key: str, value: Optional[str]) -> None:
    if value is not None and any(ch in value for ch in _UNSAFE):
        raise ConfigError(key, f"{value!r} contains a newline, NUL or backslash",
                          "remove it: such a value cannot be passed to Slurm safely")
