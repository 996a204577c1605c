"""Warm standbys (supervisor.standby): trainer processes started ahead of time, kept alive, replaced when one dies.

The supervisor's side of trainer/standby.py. Which nodes hold one (`standby_nodes`, pure):
  buffers  every buffer node: a relaunch that swaps a buffer in finds that node's ranks warm
  all      the buffer nodes and the nodes the trainer runs on, so every rank of a relaunch is warm (a second copy
           of the model on every active node: for CPU runs, or GPUs with room to spare)
  off      none
A standby is a step of its own (`cluster.launch` of the trainer with --standby on one node), so it runs wherever and
however the trainer would. Pools are synced on every supervisor poll: a standby that a relaunched rank took over is
now part of that attempt (it dies with it); a node that still wants one gets a fresh one. A standby that ends on its
own before use is reported in the journal and replaced, at most `MAX_FAILURES` times per node; after that the node's
ranks start cold. Nothing here decides whether a standby is used: the launched task checks it first (alive, fresh,
same GPUs), so a dead or frozen standby is never swapped in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_launch.orchestrator.backend import Cluster, Step
from moe_launch.rundir import RunDir, journal_event
from moe_launch.trainer.standby import STANDBY_DIR, STANDBY_ID_ENV

MODES = ("off", "buffers", "all")
MAX_FAILURES = 3


def standby_nodes(mode: str, active: tuple[str, ...], buffers: tuple[str, ...]) -> tuple[str, ...]:
    """Nodes that should hold a standby. Pure."""
    if mode == "all":
        return tuple(dict.fromkeys(active + buffers))
    return buffers if mode == "buffers" else ()


def standby_mode(sup_cfg: Any) -> str:
    """supervisor.standby, or off when supervisor.trainer_command replaces the trainer: the standby protocol
    (--standby, the hand-over files) is the embedded trainer's."""
    return "off" if sup_cfg.trainer_command else sup_cfg.standby


def all_taken(standby_dir: Path, node: str, standby_id: str) -> bool:
    """Every slot record of `node` written by the standby step `standby_id` says a launched task took it over."""
    states = []
    for path in standby_dir.glob(f"{node}-l*.json"):
        if path.name.endswith((".go.json", ".exit.json")):
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        states.append(rec.get("state") if rec.get("id") == standby_id else "other")
    return bool(states) and all(s == "taken" for s in states)


class StandbyPool:
    def __init__(self, cluster: Cluster, rd: RunDir, argv: list[str], mode: str):
        self.cluster, self.rd, self.argv, self.mode = cluster, rd, list(argv), mode
        self.dir = rd.root / STANDBY_DIR
        self.idle: dict[str, Step] = {}  # node -> its standby step, not taken yet
        self.ids: dict[str, str] = {}  # node -> the id of its idle standby step (its records carry it)
        self.serving: list[Step] = []  # standbys a launched rank took over: part of an attempt now
        self.failures: dict[str, int] = {}
        self.started: dict[str, int] = {}

    def sync(self, active: tuple[str, ...], buffers: tuple[str, ...], training: bool) -> None:
        """`training`: the current attempt has passed its first step, so its ranks have taken over whatever
        standbys they were going to."""
        want = set(standby_nodes(self.mode, active, buffers))
        self.serving = [s for s in self.serving if s.poll() is None]
        for node, step in list(self.idle.items()):
            result = step.poll()
            if result is None and all_taken(self.dir, node, self.ids[node]):
                self.serving.append(self.idle.pop(node))
            elif result is not None:
                del self.idle[node]
                if node in want:
                    self._failed(node, f"exit code {result.code}{'; ' + result.detail if result.detail else ''}")
            elif node not in want and (node not in active or training):
                # excluded or suspect: never to be taken over; or swapped in and started cold (the standby was not
                # ready in time): an idle standby there would only hold the node's memory
                self.idle.pop(node).kill()
        for node in sorted(want - set(self.idle)):
            if self.failures.get(node, 0) < MAX_FAILURES:
                self._start(node)

    def _start(self, node: str) -> None:
        n = self.started.get(node, 0)
        self.started[node] = n + 1
        launched = sum(self.started.values())
        self.ids[node] = str(launched)
        # a negative attempt number of its own: a Slurm step is found by its name (moe-attempt-<n>) to be cancelled
        self.idle[node] = self.cluster.launch((node,), -launched, self.argv + ["--standby"],
                                              {STANDBY_ID_ENV: self.ids[node]}, self.rd.logs / f"standby-{node}-{n}")

    def _failed(self, node: str, detail: str) -> None:
        self.failures[node] = self.failures.get(node, 0) + 1
        left = MAX_FAILURES - self.failures[node]
        then = "replacing it" if left > 0 else "no more standbys there: a relaunch onto it starts cold"
        journal_event(self.rd, "info", (node,), message=f"standby on {node} ended before use ({detail}); {then}",
                      standby_failures=self.failures[node], log=str(self.rd.logs / f"standby-{node}-"
                                                                     f"{self.started[node] - 1}"))

    def stop(self) -> None:
        for step in list(self.idle.values()) + self.serving:
            step.kill()
        self.idle.clear()
        self.serving.clear()
