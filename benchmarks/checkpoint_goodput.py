"""Training throughput with and without full checkpoints, through the real `moe-launch` (cluster=local, one node).

    python3 benchmarks/checkpoint_goodput.py --out DIR                  # GPU: the 4-layer OLMoE shape
    python3 benchmarks/checkpoint_goodput.py --out DIR --cpu-smoke      # tiny CPU run that checks the script

Two runs of the same job, one after the other: `train.ckpt_interval=0`, then a full checkpoint due every
--interval steps (with `train.ckpt_when_busy`, default skip). Reported per run: tokens/s over the steady steps (total
tokens over the summed host-sync-to-host-sync step times of metrics.jsonl, so a checkpoint's stall counts), the
median step's tokens/s, the checkpoints taken and skipped (journal), their stall_s and durable_s, and the pinned and
scratch host memory of the checkpoint buffers. The steady window drops the first third of the steps (compilation,
allocator warm-up, the background pinning of the checkpoint buffers).

--profile-s S: where `py-spy` is installed, each run's trainer is sampled for S seconds from the middle step on
(non-blocking, idle frames included, per thread); the training thread's innermost frames, with their share of the
samples, go into the JSON, so the two runs show where a step's extra time goes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

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


def trainer_pid(run: Run) -> Optional[int]:
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "moe_launch.trainer" in cmdline and str(run.rd) in cmdline:
            return int(proc_dir.name)
    return None


def profile(run: Run, out: Path, name: str, from_step: int, seconds: float) -> threading.Thread:
    """py-spy on the trainer once metrics.jsonl reaches `from_step` (raw collapsed stacks to out/NAME-pyspy.txt)."""
    def go() -> None:
        while run.proc.poll() is None and len(read_jsonl(run.rd / "metrics.jsonl")) < from_step:
            time.sleep(0.5)
        pid = trainer_pid(run)
        if pid is None:
            return
        subprocess.run(["py-spy", "record", "--pid", str(pid), "--nonblocking", "--idle", "--threads", "--rate",
                        "250", "--duration", str(int(seconds)), "--format", "raw", "--output",
                        str(out / f"{name}-pyspy.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def main_thread_frames(path: Path, top: int = 25) -> list[tuple[str, float]]:
    """The training thread's innermost Python frames in py-spy's raw output: [(frame, share of its samples)]."""
    leaves: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or "MainThread" not in frames[0]:
            continue
        leaves[" <- ".join(reversed(frames[-3:]))] += int(count)
    total = sum(leaves.values()) or 1
    return [(frame, round(n / total, 4)) for frame, n in leaves.most_common(top)]


def run_once(root: Path, out: Path, name: str, overrides: list[str], budget_s: float,
             profile_at: Optional[tuple[int, float]] = None) -> dict[str, Any]:
    t0 = time.time()
    run = Run(root, name, overrides)
    profiler = profile(run, out, name, *profile_at) if profile_at else None
    try:
        code = run.proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        run.end()
        code = -1
    if profiler is not None:
        profiler.join(timeout=30)
    for part in ("metrics.jsonl", "journal.jsonl", "summary.json"):  # the run directory itself is too large to keep
        if (run.rd / part).exists():
            shutil.copy(run.rd / part, out / f"{name}-{part}")
    shutil.copy(root / "moe_launch.log", out / f"{name}-moe_launch.log")
    row = summarise(run, time.time() - t0, code)
    metrics = read_jsonl(run.rd / "metrics.jsonl")
    row["step_time_s"] = [round(r["step_time_s"], 4) for r in metrics]
    if (out / f"{name}-pyspy.txt").exists():
        row["main_thread_frames"] = main_thread_frames(out / f"{name}-pyspy.txt")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--interval", type=int, default=10, help="train.ckpt_interval of the checkpointed run")
    ap.add_argument("--when-busy", default="skip", help="train.ckpt_when_busy of the checkpointed run")
    ap.add_argument("--budget-s", type=float, default=240.0, help="per run")
    ap.add_argument("--profile-s", type=float, default=0.0, help="py-spy the trainer for this long (0: no)")
    ap.add_argument("overrides", nargs="*", help="more moe-launch overrides (they win over the script's)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = COMMON + (CPU if args.cpu_smoke else GPU)
    root = Path(tempfile.mkdtemp(prefix="ckpt-goodput-"))
    rows = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "overrides": base + args.overrides}
    steps = int(next(o for o in reversed(base + args.overrides) if o.startswith("train.steps=")).split("=")[1])
    at = (steps // 2, args.profile_s) if args.profile_s and shutil.which("py-spy") else None
    rows["no_checkpoints"] = run_once(root, args.out, "plain", [*base, "train.ckpt_interval=0", *args.overrides],
                                      args.budget_s, at)
    rows["checkpoints"] = run_once(root, args.out, "ckpt", [*base, f"train.ckpt_interval={args.interval}",
                                                  f"train.ckpt_when_busy={args.when_busy}", *args.overrides],
                                   args.budget_s, at)
    plain, ckpt = rows["no_checkpoints"]["tokens_per_s"], rows["checkpoints"]["tokens_per_s"]
    rows["ratio"] = round(ckpt / plain, 4) if plain and ckpt else None
    (args.out / "checkpoint_goodput.json").write_text(json.dumps(rows, indent=1))
    for run in ("no_checkpoints", "checkpoints"):  # one line per list: the device returns only the output's tail
        print(run, json.dumps({k: v for k, v in rows[run].items() if k != "main_thread_frames"}))
        for frame, share in rows[run].get("main_thread_frames", []):
            print(f"  {share:7.2%}  {frame}")
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
