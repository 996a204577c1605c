"""Preflight: decide which of the allocated nodes may run the job.

    run_preflight(nodes, health_cfg, cluster_cfg, out_dir, run_name) -> PreflightResult

Order (the handbook's routine, made automatic):
  1. quarantined nodes are excluded without being tested (`moe-health release NODE` brings one back);
  2. per node, in parallel: DCGM diagnostics and the compute check (health/node_check.py); a node whose task does not
     report fails; GPU TFLOP/s is compared with the stored baseline of its model;
  3. one all-to-all over every surviving node (cluster.tasks_per_node ranks per node), judged against the baseline
     for (cluster, node count, ranks per node, message size, backend); the first healthy run records it;
  4. if it failed and health.alltoall.isolate: isolation (health/isolate.py) names the responsible node(s); nodes it
     can neither clear nor convict are failed too, with a reason that says so (a slow allocation is not accepted).
Everything lands under out_dir/preflight-NNN/ (raw outputs, preflight.json) and in the cluster's history store.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from moe_launch.conf.schema import ClusterConfig, HealthConfig
from moe_launch.health import baselines, store
from moe_launch.health.alltoall import A2ARow, default_max_bytes, size_ladder
from moe_launch.health.exec import TaskOutcome, python_exe, run_per_node, run_ranks
from moe_launch.health.isolate import GroupMeasurement, IsolationResult, isolate
from moe_launch.health.result import CHECK_ALLTOALL, CHECK_COMPUTE, CHECK_ISOLATION, CHECK_TASK, CheckResult
from moe_launch.rundir import write_json_atomic


@dataclass
class PreflightResult:
    nodes: list[str]
    healthy: list[str]
    failed: dict[str, list[str]]  # node -> reasons
    results: list[CheckResult]
    quarantined: list[str] = field(default_factory=list)
    alltoall: Optional[dict[str, Any]] = None
    isolation: Optional[dict[str, Any]] = None
    out_dir: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["results"] = [r.to_dict() for r in self.results]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)


@dataclass
class A2ARun:
    """One all-to-all over a node group, as the worker reported it."""

    nodes: list[str]
    sizes: list[int]  # requested bytes per rank (baseline keys use these)
    rows: list[A2ARow]
    backend: str
    outcome: TaskOutcome

    @property
    def error(self) -> Optional[str]:
        if self.rows:
            return None
        why = "timed out" if self.outcome.timed_out else f"exit {self.outcome.returncode}"
        return f"all-to-all over {len(self.nodes)} nodes did not run ({why}): {self.outcome.tail(300)}"


# share of a GPU's free memory the compute check fills: a Slurm node is ours alone during preflight; a local machine's
# GPUs are shared with the running attempt's trainer while suspects are re-checked in the background
_MEM_FILL = {"slurm": 0.85, "local": 0.25}


def _next_attempt_dir(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    n = 1 + max([int(p.name.split("-")[-1]) for p in out_dir.glob("preflight-[0-9][0-9][0-9]")] or [0])
    d = out_dir / f"preflight-{n:03d}"
    d.mkdir()
    return d


def _health_json(cfg: HealthConfig) -> str:
    return json.dumps(asdict(cfg))


def node_checks(nodes: list[str], cfg: HealthConfig, cluster: ClusterConfig, work: Path) -> list[CheckResult]:
    """Step 2: run node_check on every node in parallel and read back what each wrote."""
    ndir = work / "nodes"
    argv = [python_exe(cluster), "-m", "moe_launch.health.node_check", "--out", str(ndir),
            "--health-json", _health_json(cfg), "--mem-fraction", str(_MEM_FILL[cluster.kind])]
    timeout = (cfg.dcgm.timeout_s if cfg.dcgm.enabled else 0) + 300
    outcomes = run_per_node(nodes, argv, cluster, timeout)
    results = []
    for node in nodes:
        path = ndir / f"{node}.node.json"
        o = outcomes[node]
        (ndir / f"{node}.log").write_text(o.stdout + o.stderr)
        if path.exists():
            results += [CheckResult.from_dict(d) for d in json.loads(path.read_text())]
        else:
            why = "timed out" if o.timed_out else f"exit {o.returncode}"
            results.append(CheckResult(node, CHECK_TASK, "fail", reasons=[
                f"health task on {node} did not report ({why}): {o.tail(300)}"]))
    return results


def judge_compute_baselines(results: list[CheckResult], cfg: HealthConfig, data: dict, run: str) -> bool:
    """GPU results only: compare TFLOP/s with the model's baseline, or record the first one. Returns 'changed'."""
    changed = False
    for r in results:
        if r.check != CHECK_COMPUTE or not str(r.details.get("device", "")).startswith("cuda") or r.value is None:
            continue
        key = baselines.compute_key(r.details["device_name"], r.details["dtype"], r.details["size"])
        stored = data["compute"].get(key)
        if stored is None and r.status == "pass":
            baselines.record_compute(data, key, r.value, r.node, run)
            changed = True
            continue
        reasons = baselines.judge_compute(r.value, stored["tflops"] if stored else None, cfg.gpu_check_threshold)
        if reasons:
            r.status, r.reasons = "fail", r.reasons + reasons
    return changed


def run_alltoall(nodes: list[str], sizes: list[int], cfg: HealthConfig, cluster: ClusterConfig, work: Path,
                 label: str) -> A2ARun:
    out = work / "alltoall" / f"{label}.json"
    argv = [python_exe(cluster), "-m", "moe_launch.health.alltoall", "--out", str(out),
            "--sizes", ",".join(map(str, sizes)), "--iters", str(cfg.alltoall.iters),
            "--delay-json", json.dumps(cfg.inject_delay), "--timeout-s", str(cfg.alltoall.timeout_s),
            "--backend", _backend(cluster)]
    outcome = run_ranks(nodes, cluster.tasks_per_node, argv, cluster, cfg.alltoall.timeout_s + 60)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".log").write_text(outcome.stdout + outcome.stderr)
    if not (outcome.ok and out.exists()):
        return A2ARun(nodes, sizes, [], "?", outcome)
    record = json.loads(out.read_text())
    return A2ARun(nodes, sizes, [A2ARow(**row) for row in record["rows"]], record["backend"], outcome)


def _backend(cluster: ClusterConfig) -> str:
    # local "nodes" share one machine's devices, so only Slurm GPU nodes get one NCCL rank per GPU
    return "nccl" if cluster.kind == "slurm" and cluster.gpus_per_node > 0 else "gloo"


def _sizes(cfg: HealthConfig, cluster: ClusterConfig) -> list[int]:
    on_gpu = _backend(cluster) == "nccl"
    return size_ladder(cfg.alltoall.min_bytes, default_max_bytes(cfg.alltoall.max_bytes, on_gpu))


def alltoall_step(nodes: list[str], cfg: HealthConfig, cluster: ClusterConfig, work: Path, data: dict,
                  run: str, force_record: bool = False,
                  judge_bandwidth: bool = True) -> tuple[A2ARun, str, list[str], Optional[float], bool]:
    """Step 3. Returns (run, status, reasons, baseline busbw, baselines changed). Without judge_bandwidth only wrong
    elements fail it, and no baseline is read or recorded."""
    sizes = _sizes(cfg, cluster)
    a2a = run_alltoall(nodes, sizes, cfg, cluster, work, f"all-{len(nodes)}")
    if a2a.error:
        return a2a, "fail", [a2a.error], None, False
    rpn = cluster.tasks_per_node

    def key(size: int) -> baselines.A2AKey:
        return baselines.A2AKey(cluster.name, len(nodes), rpn, size, a2a.backend)

    base = None if force_record or not judge_bandwidth else baselines.a2a_baseline(data, key(sizes[-1]))
    status, reasons = baselines.judge_alltoall(a2a.rows, base, cfg.alltoall.threshold)
    changed = False
    if status == "pass" and judge_bandwidth:
        for size, row in zip(sizes, a2a.rows):
            if force_record or baselines.a2a_baseline(data, key(size)) is None:
                baselines.record_alltoall(data, key(size), row, nodes, run)
                changed = True
    return a2a, status, reasons, base, changed


def isolation_step(nodes: list[str], cfg: HealthConfig, cluster: ClusterConfig, work: Path, data: dict,
                   backend: str, depth: Optional[float]) -> IsolationResult:
    size = _sizes(cfg, cluster)[-1]

    def measure(group: list[str]) -> GroupMeasurement:
        a2a = run_alltoall(group, [size], cfg, cluster, work, "iso-" + "_".join(group))
        if a2a.error:
            return GroupMeasurement(tuple(group), 0.0, 0, a2a.error)
        return GroupMeasurement(tuple(group), a2a.rows[-1].busbw_gbs, a2a.rows[-1].wrong)

    def baseline(n: int) -> Optional[float]:
        return baselines.a2a_baseline(data, baselines.A2AKey(cluster.name, n, cluster.tasks_per_node, size, backend))

    return isolate(nodes, measure, baseline, cfg.alltoall.threshold, depth)


def _fail_reasons(results: list[CheckResult]) -> dict[str, list[str]]:
    failed: dict[str, list[str]] = {}
    for r in results:
        if r.failed and r.check != CHECK_ALLTOALL:
            failed.setdefault(r.node, []).extend(f"{r.check}: {why}" for why in (r.reasons or ["failed"]))
    return failed


def run_preflight(nodes: list[str], health_cfg: HealthConfig, cluster_cfg: ClusterConfig, out_dir: Path,
                  run_name: str, force_baseline: bool = False, judge_bandwidth: bool = True) -> PreflightResult:
    """judge_bandwidth=False: the all-to-all checks correctness only (nodes that share one machine's cores have no
    bandwidth of their own to compare with a baseline)."""
    t0 = time.time()
    cfg, cluster = health_cfg, cluster_cfg
    work = _next_attempt_dir(Path(out_dir))
    cdir = store.cluster_dir(cfg, cluster.name)
    bpath = Path(cfg.alltoall.baseline_path).expanduser()
    data = baselines.load(bpath)
    changed = False

    quarantine = store.quarantined_nodes(cdir)
    held = [n for n in nodes if n in quarantine]
    failed: dict[str, list[str]] = {
        n: [f"quarantined: failed in {quarantine[n].get('failures', '?')} runs within health.quarantine_window_h; "
            f"after repair run `moe-health release {n}`"] for n in held}
    candidates = [n for n in nodes if n not in held]

    results: list[CheckResult] = []
    if candidates and (cfg.dcgm.enabled or cfg.gpu_check):
        results += node_checks(candidates, cfg, cluster, work)
        changed |= judge_compute_baselines(results, cfg, data, run_name)
    survivors = [n for n in candidates if n not in _fail_reasons(results)]

    a2a_info, iso_info = None, None
    if cfg.alltoall.enabled and len(survivors) * cluster.tasks_per_node >= 2:
        a2a, status, reasons, base, ch = alltoall_step(survivors, cfg, cluster, work, data, run_name, force_baseline,
                                                       judge_bandwidth)
        changed |= ch
        busbw = a2a.rows[-1].busbw_gbs if a2a.rows else None
        a2a_info = {"nodes": survivors, "sizes": a2a.sizes, "backend": a2a.backend, "status": status,
                    "rows": [asdict(r) for r in a2a.rows], "baseline_busbw_gbs": base, "reasons": reasons}
        results += [CheckResult(n, CHECK_ALLTOALL, status, value=busbw, reasons=reasons,
                                details={"group_nodes": survivors, "baseline_busbw_gbs": base}) for n in survivors]
        if status == "fail" and cfg.alltoall.isolate and len(survivors) >= 2:
            wrong = any(r.wrong for r in a2a.rows)
            depth = busbw / base if (base and busbw is not None and not wrong) else None
            iso = isolation_step(survivors, cfg, cluster, work, data, a2a.backend, depth)
            iso_info = iso.to_dict()
            for n in iso.bad:
                results.append(CheckResult(n, CHECK_ISOLATION, "fail", reasons=[
                    "every all-to-all sub-group containing this node was slow or wrong; exclude it"],
                    details=iso_info))
            for n in iso.inconclusive:
                results.append(CheckResult(n, CHECK_ISOLATION, "warn", reasons=[
                    "isolation could neither clear nor convict this node"], details=iso_info))
        if status == "fail":
            # nodes not cleared by isolation share the failed all-to-all: they are not accepted
            cleared = set(iso_info["cleared"]) if iso_info else set()
            for n in survivors:
                if n not in cleared:
                    failed.setdefault(n, []).extend(f"alltoall: {why}" for why in reasons)

    for node, why in _fail_reasons(results).items():
        failed.setdefault(node, []).extend(w for w in why if w not in failed.get(node, []))
    healthy = [n for n in nodes if n not in failed]
    result = PreflightResult(nodes=list(nodes), healthy=healthy, failed=failed, results=results, quarantined=held,
                             alltoall=a2a_info, isolation=iso_info, out_dir=str(work), wall_s=time.time() - t0)
    if changed:
        baselines.save(bpath, data)
    store.append_results(cdir, results, run_name)
    store.update_quarantine(cdir, cfg)
    write_json_atomic(work / "preflight.json", result.to_dict())
    write_json_atomic(Path(out_dir) / "preflight.json", result.to_dict())
    return result
