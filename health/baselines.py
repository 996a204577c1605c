"""Stored baselines: all-to-all busbw per (cluster, node count, ranks per node, message size, backend) and compute
TFLOP/s per device model, in one JSON file (health.alltoall.baseline_path).

    {"alltoall": {"<cluster>|nodes=4|rpn=8|bytes=8589934592|nccl": {"busbw_gbs": .., "algbw_gbs": .., "time_s": ..,
                                                                     "nodes": [...], "run": "..", "recorded": t}},
     "compute": {"NVIDIA H200|bf16|8192": {"tflops": .., "nodes": [...], "run": "..", "recorded": t}}}

The handbook's rule: compare only like with like (same node count, GPUs per node, message size), record the node
list with the numbers, and accept >= 90% of the baseline with zero wrong elements. The first healthy run of a key
records it; `moe-health baseline` re-records on purpose. Judging is pure; reading and writing are at the edges.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from moe_launch.health.alltoall import A2ARow
from moe_launch.rundir import write_json_atomic


@dataclass(frozen=True)
class A2AKey:
    cluster: str
    nodes: int
    ranks_per_node: int
    bytes: int
    backend: str

    def __str__(self) -> str:
        return f"{self.cluster}|nodes={self.nodes}|rpn={self.ranks_per_node}|bytes={self.bytes}|{self.backend}"


def compute_key(device_name: str, dtype: str, size: int) -> str:
    return f"{device_name}|{dtype}|{size}"


def load(path: Path) -> dict[str, Any]:
    path = Path(path).expanduser()
    if not path.exists():
        return {"alltoall": {}, "compute": {}}
    data = json.loads(path.read_text())
    data.setdefault("alltoall", {})
    data.setdefault("compute", {})
    return data


def save(path: Path, data: dict[str, Any]) -> None:
    write_json_atomic(Path(path).expanduser(), data)


def a2a_baseline(data: dict[str, Any], key: A2AKey) -> Optional[float]:
    entry = data["alltoall"].get(str(key))
    return float(entry["busbw_gbs"]) if entry else None


def judge_alltoall(
    rows: list[A2ARow], baseline_busbw: Optional[float], threshold: float
) -> tuple[str, list[str]]:
    """Pure. Wrong elements at any size fail; the largest size is compared with its baseline (small messages are
    latency-bound and noisy). No baseline yet -> pass, and the caller records one."""
    reasons = [f"all-to-all at {r.bytes} B: {r.wrong} wrong elements" for r in rows if r.wrong]
    judged = rows[-1]
    if baseline_busbw is not None and judged.busbw_gbs < threshold * baseline_busbw:
        reasons.append(
            f"all-to-all busbw {judged.busbw_gbs:.3f} GB/s at {judged.bytes} B is below "
            f"health.alltoall.threshold={threshold} x baseline {baseline_busbw:.3f} GB/s"
        )
    return ("fail" if reasons else "pass"), reasons


def record_alltoall(data: dict[str, Any], key: A2AKey, row: A2ARow, nodes: list[str], run: str) -> None:
    data["alltoall"][str(key)] = {
        "busbw_gbs": row.busbw_gbs, "algbw_gbs": row.algbw_gbs, "time_s": row.time_s,
        "nodes": list(nodes), "run": run, "recorded": time.time(),
    }


def judge_compute(tflops: float, baseline_tflops: Optional[float], threshold: float) -> list[str]:
    if baseline_tflops is not None and tflops < threshold * baseline_tflops:
        return [f"GEMM {tflops:.1f} TFLOP/s is below health.gpu_check_threshold={threshold} x baseline "
                f"{baseline_tflops:.1f} TFLOP/s for this GPU model"]
    return []


def record_compute(data: dict[str, Any], key: str, tflops: float, node: str, run: str) -> None:
    data["compute"][key] = {"tflops": tflops, "nodes": [node], "run": run, "recorded": time.time()}
