"""moe-health: stand-alone node health for an allocation or a whole cluster.

    moe-health preflight --nodes node[1-4] [--cluster slurm] [--out DIR] [key=value ...]
    moe-health baseline  --nodes node[1-4] [...]          re-record the all-to-all baselines from a healthy run
    moe-health report    [--since 24h|7d|2026-11-30T12:00] [--run runs/<name>] [--html PATH]
    moe-health release   NODE

`key=value` overrides reach the typed configs (`health.alltoall.iters=3`, `cluster.name=prod`, `cluster.kind=local`),
as in moe-launch; `--config runs/<name>/config.yaml` starts from a run's resolved config instead of the presets.
Node lists are expanded by `scontrol show hostnames` (commas alone need no Slurm).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from moe_launch.conf.presets import CLUSTERS
from moe_launch.conf.schema import ClusterConfig, HealthConfig, all_problems
from moe_launch.errors import ConfigError, MoeLaunchError
from moe_launch.health import report, store
from moe_launch.health.preflight import PreflightResult, run_preflight


def expand_nodes(spec: str) -> list[str]:
    if "[" not in spec:
        return [n for n in spec.split(",") if n]
    if shutil.which("scontrol") is None:
        raise ConfigError("--nodes", f"{spec!r} needs `scontrol show hostnames` to expand", "list nodes with commas")
    from moe_launch.orchestrator.slurm import hostnames

    return list(hostnames(spec))


def parse_since(text: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """'24h', '7d', '30m' (ago), an ISO date/time, or epoch seconds -> epoch seconds."""
    if not text:
        return None
    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([mhd])", text)
    if m:
        return now - float(m.group(1)) * {"m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ConfigError("--since", f"cannot read {text!r}", "use e.g. 24h, 7d, 30m or 2026-11-30T12:00") from None


def load_configs(config: Optional[str], cluster_preset: str,
                 overrides: list[str]) -> tuple[HealthConfig, ClusterConfig]:
    if cluster_preset not in CLUSTERS:
        raise ConfigError("--cluster", f"unknown preset {cluster_preset!r}", f"use one of {', '.join(CLUSTERS)}")
    health = OmegaConf.structured(HealthConfig)
    cluster = OmegaConf.structured(CLUSTERS[cluster_preset])
    if config:
        raw = OmegaConf.load(config)
        health = OmegaConf.merge(health, raw.get("health", {}))
        cluster = OmegaConf.merge(cluster, raw.get("cluster", {}))
    dot = OmegaConf.from_dotlist(overrides)
    for key in dot:
        if key not in ("health", "cluster"):
            raise ConfigError(str(key), "moe-health only reads health.* and cluster.* overrides",
                              "drop the override or pass it to moe-launch")
    health = OmegaConf.merge(health, dot.get("health", {}))
    cluster = OmegaConf.merge(cluster, dot.get("cluster", {}))
    with all_problems():  # every bad value in one message
        return OmegaConf.to_object(health), OmegaConf.to_object(cluster)


def preflight_table(result: PreflightResult) -> Table:
    table = Table(title=f"preflight of {len(result.nodes)} nodes: {len(result.healthy)} healthy")
    for col in ("node", "check", "status", "value", "reasons"):
        table.add_column(col)
    for r in sorted(result.results, key=lambda r: (r.node, r.check)):
        value = f"{r.value:.4g}" if r.value is not None else ""
        table.add_row(r.node, r.check, r.status, value, "; ".join(r.reasons)[:160])
    for node in result.quarantined:
        table.add_row(node, "quarantine", "fail", "", "; ".join(result.failed[node]))
    return table


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="moe-health", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("preflight", "baseline"):
        sp = sub.add_parser(name)
        sp.add_argument("--nodes", required=True, help="node list, e.g. node[1-4] or a,b,c")
        sp.add_argument("--out", default=None, help="where raw outputs go (default: ./health-<time>)")
        sp.add_argument("--run-name", default=None)
    sr = sub.add_parser("report")
    sr.add_argument("--since", default=None, help="24h, 7d, 30m or an ISO date (default: all history)")
    sr.add_argument("--run", default=None, help="a run directory: its own history (cluster=local runs keep it there)")
    sr.add_argument("--runs-root", default="runs", help="where to look for runs' histories when the cluster store "
                    "has none (default: runs)")
    sr.add_argument("--html", default=None, help="page to write (default: report.html in the store, or in the "
                    "run's health/ directory)")
    sl = sub.add_parser("release")
    sl.add_argument("node")
    for sp in sub.choices.values():
        sp.add_argument("--config", default=None, help="a resolved run config.yaml to take health/cluster from")
        sp.add_argument("--cluster", default="slurm", help=f"cluster preset: {', '.join(CLUSTERS)}")
        sp.epilog = "Any further key=value arguments override health.* / cluster.* settings."
    # key=value overrides may come anywhere (after a positional NODE too), so they are collected as the extras
    a, extras = p.parse_known_args(argv)
    bad = [x for x in extras if "=" not in x or x.startswith("-")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    console = Console()
    try:
        health, cluster = load_configs(a.config, a.cluster, extras)
        cdir = store.cluster_dir(health, cluster.name)
        if a.cmd in ("preflight", "baseline"):
            nodes = expand_nodes(a.nodes)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            out = Path(a.out or f"health-{stamp}")
            result = run_preflight(nodes, health, cluster, out, a.run_name or f"{a.cmd}-{stamp}",
                                   force_baseline=a.cmd == "baseline")
            console.print(preflight_table(result))
            if result.alltoall:
                console.print(f"all-to-all over {len(result.alltoall['nodes'])} nodes: {result.alltoall['status']}")
            if result.isolation:
                iso = result.isolation
                console.print(f"isolation: bad={iso['bad']} inconclusive={iso['inconclusive']}")
            console.print(f"results: {result.out_dir}/preflight.json")
            return 0 if result.ok else 1
        if a.cmd == "report":
            since = parse_since(a.since)
            src = report.history_sources(cdir, Path(a.run) if a.run else None, Path(a.runs_root))
            if not src.dirs:
                console.print("no health history found; looked in: " + ", ".join(src.looked) +
                              " (pass --run runs/<name>, or --cluster / cluster.name= / health.store_dir=)")
                return 1
            history = sorted((r for d in src.dirs for r in store.read_history(d)), key=lambda r: r.get("time", 0))
            quarantined = {n: q for d in src.dirs for n, q in store.quarantined_nodes(d).items()}
            html_path = Path(a.html) if a.html else src.out_dir / "report.html"
            console.print(report.build(history, quarantined, since, cluster.name, html_path,
                                       source=", ".join(map(str, src.dirs))))
            console.print(f"history from {', '.join(map(str, src.dirs))}; wrote {html_path}")
            if src.not_shown:
                console.print(f"{len(src.not_shown)} run(s) under {a.runs_root}/ keep their own history "
                              f"(cluster=local): moe-health report --run {src.not_shown[-1].parents[2]}")
            return 0
        if a.cmd == "release":
            was = store.release(cdir, a.node)
            console.print(f"{a.node}: {'released from quarantine' if was else 'was not quarantined'} ({cdir})")
            return 0
    except MoeLaunchError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
