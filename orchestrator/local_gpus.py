"""cluster.kind=local on a machine with GPUs: which GPU each local "node" uses.

Local nodes are process groups on one machine, so they share its GPUs. Three rules keep them from colliding:
  * the ranks of one trainer step each get their own GPU: the step's i-th node sees GPUs
    [i*tasks_per_node, (i+1)*tasks_per_node) of the visible list through CUDA_VISIBLE_DEVICES (`step_devices`);
  * preflight gives every node a GPU slot (node j -> slot j mod slots); nodes that share a slot run their node checks
    one after another, never together (`preflight_waves`);
  * the default layout (cluster=local with no layout overrides) is fitted to the GPUs present: with one GPU the
    trainer runs one node, with the buffer sharing its GPU (`fit_layout`). An explicit layout with more ranks than
    GPUs is refused, since two ranks on one GPU cannot form an NCCL group.

The only side effect is `visible_gpus()`, which asks CUDA_VISIBLE_DEVICES or `nvidia-smi -L` (not torch: the login
side does not import it).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from typing import Iterable, Mapping, Optional

from moe_launch.conf.schema import RootConfig
from moe_launch.errors import ConfigError

# overrides that mean "the user chose the layout": then it is checked against the GPUs, never changed
LAYOUT_KEYS = ("cluster.nodes", "cluster.tasks_per_node", "parallel", "model.moe.num_experts")


def visible_gpus(env: Optional[Mapping[str, str]] = None) -> tuple[str, ...]:
    """GPU ids we may use: CUDA_VISIBLE_DEVICES when set (empty: none), else every GPU that nvidia-smi lists."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = tuple(x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(",") if x.strip())
        return () if ids in ((), ("-1",)) else ids
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU "))


def layout_overridden(overrides: Iterable[str]) -> bool:
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    return any(k == p or k.startswith(p + ".") for k in keys for p in LAYOUT_KEYS)


def fit_layout(cfg: RootConfig, gpus: int, user_layout: bool) -> tuple[RootConfig, Optional[str]]:
    """Pure: the config to run with `gpus` GPUs on this machine, and a note saying what was fitted (or None).

    CPU machines and Slurm runs are unchanged. With GPUs, trainer ranks (cluster.nodes * tasks_per_node) must not
    outnumber them; the default layout shrinks to fit (data parallelism first), a chosen one is refused."""
    c = cfg.cluster
    if c.kind != "local" or gpus == 0:
        return cfg, None
    ranks = c.nodes * c.tasks_per_node
    if ranks <= gpus:
        return cfg, (f"cluster=local: {ranks} trainer rank(s) on {gpus} GPU(s), one GPU each; "
                     f"buffer node(s) share the GPUs of the nodes they replace")
    fix = (f"use at most {gpus} rank(s): cluster.nodes * cluster.tasks_per_node <= {gpus} with parallel.dp*ep*pp "
           f"to match, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU")
    problem = f"{c.nodes} node(s) x {c.tasks_per_node} task(s) = {ranks} GPU ranks but this machine has {gpus} GPU(s)"
    if user_layout or c.tasks_per_node > gpus:
        raise ConfigError("cluster.nodes", problem, fix)
    nodes = gpus // c.tasks_per_node
    p = cfg.parallel
    if nodes * c.tasks_per_node % (p.ep * p.pp):
        raise ConfigError("cluster.nodes", f"{problem}, and ep*pp = {p.ep * p.pp} does not divide the "
                          f"{nodes * c.tasks_per_node} rank(s) that fit", fix)
    dp = nodes * c.tasks_per_node // (p.ep * p.pp)
    try:
        fitted = replace(cfg, cluster=replace(c, nodes=nodes), parallel=replace(p, dp=dp))
    except ConfigError as e:
        raise ConfigError("cluster.nodes", f"{problem}, and the layout cannot shrink to fit ({e})", fix) from None
    note = (f"cluster=local on a machine with {gpus} GPU(s): the default layout is fitted to them: cluster.nodes="
            f"{nodes}, parallel.dp={dp} (one GPU per rank; the {c.buffers} buffer node(s) share those GPUs). "
            f"Set cluster.nodes / parallel.* yourself to choose another layout")
    return fitted, note


def step_devices(nodes: tuple[str, ...], gpus: tuple[str, ...], tasks_per_node: int) -> dict[str, str]:
    """Pure: CUDA_VISIBLE_DEVICES for each node of one trainer step (its i-th node gets the i-th block of GPUs).
    Empty when the machine has no GPUs."""
    if not gpus:
        return {}
    if len(nodes) * tasks_per_node > len(gpus):
        raise ConfigError("cluster.nodes", f"a step on {len(nodes)} node(s) x {tasks_per_node} task(s) needs "
                          f"{len(nodes) * tasks_per_node} GPUs, this machine has {len(gpus)}",
                          "lower cluster.nodes or cluster.tasks_per_node")
    return {node: ",".join(gpus[i * tasks_per_node:(i + 1) * tasks_per_node]) for i, node in enumerate(nodes)}


def preflight_waves(nodes: list[str], gpus: tuple[str, ...], tasks_per_node: int) -> list[dict[str, str]]:
    """Pure: the nodes' per-node checks as waves that run one after another; within a wave no two nodes share a GPU.
    Each wave maps node -> CUDA_VISIBLE_DEVICES. Without GPUs: one wave, all nodes together."""
    if not gpus:
        return [{n: "" for n in nodes}] if nodes else []
    per = max(1, min(tasks_per_node, len(gpus)))
    slots = len(gpus) // per
    waves: list[dict[str, str]] = []
    for j, node in enumerate(nodes):
        slot = j % slots
        if j // slots >= len(waves):
            waves.append({})
        waves[j // slots][node] = ",".join(gpus[slot * per:(slot + 1) * per])
    return waves
