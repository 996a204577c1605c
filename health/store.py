"""Per-cluster health history and quarantine, under health.store_dir/<cluster name>/.

history.jsonl    one line per check result: time, node, check, status, value, run (+ reasons, nodes for group checks)
quarantine.json  {"quarantined": {node: {"since": t, "failures": k}}, "released": {node: t}}

A node is quarantined when it failed in >= health.quarantine_failures distinct runs within
health.quarantine_window_h hours, counting only failures it is answerable for on its own (DCGM, compute, the health
task not reporting, being named by isolation, or blamed by the supervisor during training: node lost, NaN/Inf on its
rank, a hang; a slow all-to-all of a whole group counts against nobody).
`release` forgives the failures before it. The decision (`quarantine_decision`) is pure; the rest reads/writes files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from moe_launch.conf.schema import HealthConfig
from moe_launch.health.result import (
    CHECK_COMPUTE,
    CHECK_DCGM,
    CHECK_IN_RUN,
    CHECK_ISOLATION,
    CHECK_TASK,
    CheckResult,
)
from moe_launch.rundir import append_jsonl, read_jsonl, write_json_atomic

NODE_CHECKS = (CHECK_DCGM, CHECK_COMPUTE, CHECK_TASK, CHECK_ISOLATION, CHECK_IN_RUN)


def cluster_dir(cfg: HealthConfig, cluster_name: str) -> Path:
    return Path(cfg.store_dir).expanduser() / cluster_name


def history_path(cdir: Path) -> Path:
    return cdir / "history.jsonl"


def quarantine_path(cdir: Path) -> Path:
    return cdir / "quarantine.json"


def history_record(r: CheckResult, run: str) -> dict[str, Any]:
    rec = {"time": r.time, "node": r.node, "check": r.check, "status": r.status, "value": r.value, "run": run,
           "reasons": r.reasons}
    if "group_nodes" in r.details:
        rec["nodes"] = len(r.details["group_nodes"])
    return rec


def append_results(cdir: Path, results: Iterable[CheckResult], run: str) -> None:
    for r in results:
        append_jsonl(history_path(cdir), history_record(r, run))


def read_history(cdir: Path, since: Optional[float] = None) -> list[dict[str, Any]]:
    rows = read_jsonl(history_path(cdir))
    return [r for r in rows if since is None or r.get("time", 0) >= since]


def read_quarantine(cdir: Path) -> dict[str, Any]:
    p = quarantine_path(cdir)
    data = json.loads(p.read_text()) if p.exists() else {}
    data.setdefault("quarantined", {})
    data.setdefault("released", {})
    return data


def failing_runs(history: list[dict[str, Any]], released: dict[str, float], window_h: float,
                 now: float) -> dict[str, set[str]]:
    """Pure: node -> the runs in the window (and after its last release) in which it failed a node check."""
    start = now - window_h * 3600
    out: dict[str, set[str]] = {}
    for rec in history:
        node, t = rec.get("node", ""), rec.get("time", 0)
        if rec.get("status") != "fail" or rec.get("check") not in NODE_CHECKS:
            continue
        if t < start or t <= released.get(node, 0):
            continue
        out.setdefault(node, set()).add(str(rec.get("run")))
    return out


def quarantine_decision(history: list[dict[str, Any]], released: dict[str, float], k: int, window_h: float,
                        now: float) -> dict[str, int]:
    """Pure: node -> failure count, for nodes that must be quarantined."""
    return {n: len(runs) for n, runs in failing_runs(history, released, window_h, now).items() if len(runs) >= k}


def update_quarantine(cdir: Path, cfg: HealthConfig, now: Optional[float] = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    data = read_quarantine(cdir)
    decided = quarantine_decision(read_history(cdir), data["released"], cfg.quarantine_failures,
                                  cfg.quarantine_window_h, now)
    for node, count in decided.items():
        entry = data["quarantined"].setdefault(node, {"since": now})
        entry["failures"] = count
    write_json_atomic(quarantine_path(cdir), data)
    return data


def quarantined_nodes(cdir: Path) -> dict[str, dict[str, Any]]:
    return read_quarantine(cdir)["quarantined"]


def release(cdir: Path, node: str, now: Optional[float] = None) -> bool:
    """Returns whether the node was quarantined. Its earlier failures no longer count."""
    data = read_quarantine(cdir)
    was = data["quarantined"].pop(node, None) is not None
    data["released"][node] = time.time() if now is None else now
    write_json_atomic(quarantine_path(cdir), data)
    return was


def record_in_run(cdir: Path, cfg: HealthConfig, blamed: dict[str, str], run: str) -> None:
    """Nodes the supervisor blamed during training (node -> why) join the history, so quarantine learns from them."""
    if blamed:
        append_results(cdir, [CheckResult(n, CHECK_IN_RUN, "fail", reasons=[why]) for n, why in blamed.items()], run)
        update_quarantine(cdir, cfg)
