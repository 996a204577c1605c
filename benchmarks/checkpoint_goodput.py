"""Training throughput with and without full checkpoints, through the real `moe-launch` (cluster=local, one node).

    python3 benchmarks/checkpoint_goodput.py --out DIR                  # GPU: the 4-layer OLMoE shape
    python3 benchmarks/checkpoint_goodput.py --out DIR --cpu-smoke      # tiny CPU run that checks the script

Two runs of the same job, one after the other: `train.ckpt_interval=0`, then a full checkpoint due every
--interval steps (with `train.ckpt_when_busy`, default skip). Reported per run: tokens/s over the steady steps (total
tokens over the summed host-sync-to-host-sync step times of metrics.jsonl, so a checkpoint's stall counts), the
median step's tokens/s, the checkpoints taken and skipped (journal), their stall_s and durable_s, and the pinned and
scratch host memory of the checkpoint buffers. The steady window drops the first third of the steps (compilation,
allocator warm-up, the background pinning of the checkpoint buffers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery import Run, read_jsonl  # noqa: E402

GPU = ["model=olmoe_1b7b", "model.n_layers=4", "train.compile=true", "train.seq_len=4096",
       "train.global_batch_size=4", "train.micro_batch_size=4", "train.lr=4e-4", "train.steps=200"]
CPU = ["train.seq_len=32", "train.global_batch_size=2", "train.micro_batch_size=1", "train.steps=60"]
COMMON = ["cluster=local", "cluster.nodes=1", "cluster.buffers=0", "parallel.dp=1", "health.preflight=false",
          "train.progress=false", "train.tracking=[]"]


def summarise(run: Run, wall_s: float, code: int) -> dict[str, Any]:
    metrics = read_jsonl(run.rd / "metrics.jsonl")
    journal = run.journal()
    steady = metrics[len(metrics) // 3:]
    tokens = [r["tokens_per_s"] * r["step_time_s"] for r in steady]
    ckpts = [r["details"] for r in journal if r["kind"] == "checkpoint" and "slot" in r["details"]
             and not r["details"].get("model_only")]
    skipped = [r["details"]["skipped_checkpoint"] for r in journal if "skipped_checkpoint" in r["details"]]
    return {
        "exit": code, "wall_s": round(wall_s, 1), "steps": len(metrics), "steady_steps": len(steady),
        "tokens_per_s": round(sum(tokens) / sum(r["step_time_s"] for r in steady), 1) if steady else None,
        "median_step_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady), 1) if steady else None,
        "checkpoints_taken": [c["step"] for c in ckpts], "checkpoints_skipped": skipped,
        "stall_s": [c["stall_s"] for c in ckpts], "durable_s": [c["durable_s"] for c in ckpts],
        "pinned_bytes": max((c.get("pinned_bytes", 0) for c in ckpts), default=0),
        "scratch_bytes": max((c.get("scratch_bytes", 0) for c in ckpts), default=0),
    }


def run_once(root: Path, out: Path, name: str, overrides: list[str], budget_s: float) -> dict[str, Any]:
    t0 = time.time()
    run = Run(root, name, overrides)
    try:
        code = run.proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        run.end()
        code = -1
    for part in ("metrics.jsonl", "journal.jsonl", "summary.json"):  # the run directory itself is too large to keep
        if (run.rd / part).exists():
            shutil.copy(run.rd / part, out / f"{name}-{part}")
    shutil.copy(root / "moe_launch.log", out / f"{name}-moe_launch.log")
    return summarise(run, time.time() - t0, code)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--interval", type=int, default=10, help="train.ckpt_interval of the checkpointed run")
    ap.add_argument("--when-busy", default="skip", help="train.ckpt_when_busy of the checkpointed run")
    ap.add_argument("--budget-s", type=float, default=240.0, help="per run")
    ap.add_argument("overrides", nargs="*", help="more moe-launch overrides (they win over the script's)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = COMMON + (CPU if args.cpu_smoke else GPU)
    root = Path(tempfile.mkdtemp(prefix="ckpt-goodput-"))
    rows = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "overrides": base + args.overrides}
    rows["no_checkpoints"] = run_once(root, args.out, "plain", [*base, "train.ckpt_interval=0", *args.overrides],
                                      args.budget_s)
    rows["checkpoints"] = run_once(root, args.out, "ckpt", [*base, f"train.ckpt_interval={args.interval}",
                                                  f"train.ckpt_when_busy={args.when_busy}", *args.overrides],
                                   args.budget_s)
    plain, ckpt = rows["no_checkpoints"]["tokens_per_s"], rows["checkpoints"]["tokens_per_s"]
    rows["ratio"] = round(ckpt / plain, 4) if plain and ckpt else None
    (args.out / "checkpoint_goodput.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows, indent=1))
    c = rows["checkpoints"]
    print(f"| run | tokens/s (steady) | median step | checkpoints taken / skipped | max stall s | exit |\n"
          f"|---|---|---|---|---|---|\n"
          f"| no checkpoints | {plain} | {rows['no_checkpoints']['median_step_tokens_per_s']} | - | - | "
          f"{rows['no_checkpoints']['exit']} |\n"
          f"| every {args.interval} steps, {args.when_busy} when busy | {ckpt} | {c['median_step_tokens_per_s']} | "
          f"{len(c['checkpoints_taken'])} / {len(c['checkpoints_skipped'])} | "
          f"{max(c['stall_s'], default=None)} | {c['exit']} |\n"
          f"ratio {rows['ratio']}; pinned {c['pinned_bytes'] / 1e9:.1f} GB, scratch {c['scratch_bytes'] / 1e9:.1f} GB")
    return 0 if rows["no_checkpoints"]["exit"] == 0 and c["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
