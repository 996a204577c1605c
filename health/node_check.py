"""The per-node health task: DCGM diagnostics and the compute check of every local device.

Started once per node (srun -N1 --nodelist=<node>, or a local subprocess with MOE_LAUNCH_NODE=<node>):
    python -m moe_launch.health.node_check --out DIR --health-json '<HealthConfig as JSON>'
It writes DIR/<node>.node.json (a list of CheckResult dicts) and DCGM's raw output under DIR/raw/. Judging against
stored compute baselines happens on the launching side (preflight), which sees all nodes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from moe_launch.conf.schema import HealthConfig
from moe_launch.health.alltoall import this_node
from moe_launch.health.dcgm import run_dcgm
from moe_launch.health.gpu_check import compute_check, local_devices
from moe_launch.health.result import CHECK_COMPUTE, CheckResult
from moe_launch.rundir import write_json_atomic


def health_from_json(text: str) -> HealthConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HealthConfig), json.loads(text)))


def compute_results(node: str, mem_fraction: float = 0.85) -> list[CheckResult]:
    results = []
    for device in local_devices():
        try:
            outcome = compute_check(device, mem_fraction=mem_fraction)
        except Exception as e:  # a device that cannot even run a GEMM is the finding, not a crash of the check
            results.append(CheckResult(node, CHECK_COMPUTE, "fail", reasons=[f"{device}: {type(e).__name__}: {e}"],
                                       details={"device": str(device)}))
            continue
        results.append(CheckResult(node, CHECK_COMPUTE, "pass" if outcome.ok else "fail", value=outcome.tflops,
                                   reasons=[f"{device}: {r}" for r in outcome.reasons], details=outcome.to_dict()))
    return results


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="moe-health per-node checks (DCGM + compute)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--health-json", default="{}")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="share of the GPU's free memory to fill and read")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = health_from_json(a.health_json)
    node = this_node()
    results: list[CheckResult] = []
    if cfg.dcgm.enabled:
        results.append(run_dcgm(node, cfg.dcgm, a.out / "raw"))
    if cfg.gpu_check:
        results += compute_results(node, a.mem_fraction)
    write_json_atomic(a.out / f"{node}.node.json", [r.to_dict() for r in results])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
