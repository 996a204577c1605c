"""Recovery from a fault through the real `moe-launch`, and where its seconds went.

    python3 benchmarks/recovery.py --out $OUT              # 1 GPU: 4-layer OLMoE shape, compile on (the default)
    python3 benchmarks/recovery.py --out DIR --cpu-smoke   # the same choreography with tiny_moe on the CPU
    python3 benchmarks/recovery.py --out DIR --cpu-smoke train.compile=true   # ... plus any moe-launch overrides

One run on cluster=local: 1 node + 2 buffers, warm standbys on the buffers (supervisor.standby=buffers), checkpoints
asynchronous, preflight off (not part of a recovery). Two faults, one after the other:
  nan      rank 0's loss becomes NaN at step --nan-step (train.fault_injection): the node is set aside, the first
           buffer's standby takes the rank over
  sigkill  this script SIGKILLs the training process once the second buffer's standby holds the newest durable
           checkpoint in memory and training has passed it: the node is excluded, that standby takes over
Each recovery is read from the journal: the supervisor's resume record (seconds_since_failure, from the failed
attempt's last heartbeat to the new attempt's first, and its breakdown) and the trainer's (resumed step,
from_memory). The run is then ended (every process whose command line names its run directory is killed), the
journal and log tails copied to --out, recovery.json written and a table printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

PHASES = ("detect", "relaunch", "process_start", "restore", "compile", "first_step")
# micro-batches of 1: three processes share the GPU (the trainer and two standbys warming up); checkpoints 100 steps
# apart (~30 s, about the time one takes to become durable); steps slowed a little so that the NaN comes after the
# standbys are warm and hold a durable checkpoint
GPU = ["model=olmoe_1b7b", "model.n_layers=4", "train.compile=true", "train.seq_len=4096",
       "train.global_batch_size=4", "train.micro_batch_size=1", "train.lr=4e-4", "train.ckpt_interval=100",
       "train.step_sleep_s=0.2", "train.steps=2000"]
CPU = ["train.seq_len=32", "train.global_batch_size=2", "train.micro_batch_size=1", "train.ckpt_interval=5",
       "train.step_sleep_s=0.3", "train.steps=200"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    except OSError:
        pass
    return out


def read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


class Run:
    def __init__(self, root: Path, name: str, overrides: list[str]):
        self.rd = root / "runs" / name
        launcher = shutil.which("moe-launch")
        argv = [launcher] if launcher else [sys.executable, "-m", "moe_launch.orchestrator.cli"]
        self.log = open(root / "moe_launch.log", "wb")
        self.proc = subprocess.Popen(argv + [f"run.root={root / 'runs'}", f"run.name={name}", *overrides], cwd=root,
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def journal(self) -> list[dict[str, Any]]:
        return read_jsonl(self.rd / "journal.jsonl")

    def wait(self, what: str, cond: Callable[[], Any], deadline: float) -> Any:
        while time.time() < deadline:
            value = cond()
            if value:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"moe-launch ended (exit {self.proc.returncode}) while waiting for {what}")
            time.sleep(0.2)
        raise TimeoutError(f"out of time waiting for {what}")

    def resumes(self) -> list[dict[str, Any]]:
        return [r for r in self.journal() if r["kind"] == "resume" and "seconds_since_failure" in r["details"]]

    def durable_step(self) -> Optional[int]:
        steps = [r["details"]["step"] for r in self.journal() if r["kind"] == "checkpoint"
                 and not r["details"].get("model_only") and not r["details"].get("failed")]
        return max(steps) if steps else None

    def standby(self, node: str) -> Optional[dict[str, Any]]:
        return read_json(self.rd / "standby" / f"{node}-l0.json")

    def end(self) -> None:
        """Kill moe-launch, its supervisor, trainers and standbys: every process naming this run directory."""
        mine = os.getpid()
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit() or int(proc_dir.name) == mine:
                continue
            try:
                cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(self.rd) in cmdline or f"run.name={self.rd.name}" in cmdline:
                try:
                    os.kill(int(proc_dir.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=30)


def recovery_of(run: Run, after: float) -> dict[str, Any]:
    sup = next(r for r in run.resumes() if r["time"] > after)
    trainer = next((r for r in run.journal() if r["kind"] == "resume" and "checkpoint" in r["details"]
                    and after < r["time"] <= sup["time"]), {"details": {}})
    return {"seconds": sup["details"]["seconds_since_failure"], "breakdown": sup["details"].get("breakdown", {}),
            "resumed_from_step": trainer["details"].get("step"), "from_memory": trainer["details"].get("from_memory"),
            "node": sup["nodes"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny_moe on the CPU (checks the choreography)")
    ap.add_argument("--nan-step", type=int, default=None, help="step of the NaN (default: 450 on GPU, 12 on CPU)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="give up (and clean up) after this long")
    ap.add_argument("overrides", nargs="*", help="more moe-launch overrides (they win over the script's)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    nan_step = args.nan_step or (12 if args.cpu_smoke else 450)
    overrides = ["cluster=local", "cluster.nodes=1", "cluster.buffers=2", "parallel.dp=1", "health.preflight=false",
                 "supervisor.standby=buffers", "train.progress=false", "train.fault_injection.kind=nan",
                 "train.fault_injection.rank=0", f"train.fault_injection.step={nan_step}",
                 *(CPU if args.cpu_smoke else GPU), *args.overrides]
    root = Path(tempfile.mkdtemp(prefix="recovery-"))
    t_start = time.time()
    deadline = t_start + args.budget_s
    run = Run(root, "recovery", overrides)
    results: dict[str, Any] = {"overrides": overrides, "recoveries": {}}
    try:
        run.wait("the NaN recovery", lambda: run.resumes(), deadline)
        results["recoveries"]["nan"] = recovery_of(run, 0.0)
        spare = "local3" if "local2" in results["recoveries"]["nan"]["node"] else "local2"
        t_nan = run.resumes()[0]["time"]

        standbys = "supervisor.standby=off" not in overrides

        def ready_to_kill() -> bool:  # the spare holds the newest durable checkpoint, and training went past it
            rec, durable = run.standby(spare), run.durable_step()
            beat = read_json(run.rd / "heartbeat" / "rank0.json")
            held = not standbys or bool(rec and rec.get("state") == "ready" and rec.get("held_step") == durable)
            return bool(held and durable is not None and beat and beat["time"] > t_nan and beat["step"] > durable)

        run.wait(f"{spare}'s standby holding the newest checkpoint", ready_to_kill, deadline)
        victim = read_json(run.rd / "heartbeat" / "rank0.json")
        t_kill = time.time()
        os.kill(int(victim["pid"]), signal.SIGKILL)
        results["sigkill_at_step"] = victim["step"]
        run.wait("the SIGKILL recovery", lambda: [r for r in run.resumes() if r["time"] > t_kill], deadline)
        results["recoveries"]["sigkill"] = recovery_of(run, t_kill)
    except (RuntimeError, TimeoutError) as e:
        results["error"] = str(e)
    finally:
        results["wall_s"] = round(time.time() - t_start, 1)
        run.end()
        for name in ("journal.jsonl", "metrics.jsonl", "config.yaml"):
            if (run.rd / name).exists():
                shutil.copy(run.rd / name, args.out / name)
        shutil.copy(root / "moe_launch.log", args.out / "moe_launch.log")
        with open(args.out / "log_tails.txt", "w") as f:
            for log in sorted((run.rd / "logs").glob("*/*.log")):
                f.write(f"=== {log.relative_to(run.rd)}\n" + "\n".join(log.read_text(errors="replace")
                                                                          .splitlines()[-25:]) + "\n")
        (args.out / "recovery.json").write_text(json.dumps(results, indent=2))
        shutil.rmtree(root, ignore_errors=True)  # the checkpoints: tens of GB on the GPU shape
    print(f"wall {results['wall_s']} s{'; ' + results['error'] if 'error' in results else ''}")
    print(f"{'fault':<8} {'total s':>8} " + " ".join(f"{p:>13}" for p in PHASES) + "  resumed_from  from_memory")
    for fault, r in results["recoveries"].items():
        parts = r["breakdown"]
        print(f"{fault:<8} {r['seconds']:>8.2f} " + " ".join(f"{parts.get(p, float('nan')):>13.2f}" for p in PHASES)
              + f"  {str(r['resumed_from_step']):>12}  {str(r['from_memory']):>11}")
    return 0 if "error" not in results and len(results["recoveries"]) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
