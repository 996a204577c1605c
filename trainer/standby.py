"""Warm standby: a trainer process started ahead of time that a relaunched task hands its rank to.

`python -m moe_launch.trainer --run-dir R --standby` (the supervisor starts one per rank slot of a buffer node, see
orchestrator/standby.py) imports torch, brings the CUDA context up and, when the model does not depend on the rank
(parallel.ep = parallel.pp = 1), builds it exactly as the Trainer would, compiles it and runs one forward/backward on
made-up tokens of the training shape, so the first real step finds its graphs and Triton kernels compiled. Then it
announces itself and waits, holding the newest checkpoint verified in host memory (trainer/host_restore.py), so the
restore after the hand-over reads no disk; it never writes the run's state (checkpoints, heartbeats, journal) until
told to.

The hand-over is file-based in standby/ of the run directory (shared by the nodes), one slot per (node, local rank):
  <slot>.json       the standby: pid, id (the supervisor's), state (starting | ready | taken), time (refreshed
                    every second), CUDA_VISIBLE_DEVICES,
                    held_step (the checkpoint it holds in memory)
  <slot>.go.json    the claim, created exclusively by the launched task: its rank environment, attempt, pid and
                    process start time
  <slot>.exit.json  the standby-turned-trainer's exit code
A relaunch is launched as usual (srun or local processes, same ranks, same environment). Each new task first looks
for a ready standby of its own slot (`hand_over`), before importing anything heavy. It uses one only if the record
is fresh, its process is alive and it sees the same GPUs; else it trains itself (cold) and stops that standby. A
task that handed over stays as the launcher's task: it forwards SIGTERM / SIGUSR2 to the standby, exits with the
standby's exit code, and dies by SIGKILL if the standby did (so a killed rank still looks killed to srun and to the
supervisor). The standby in turn kills itself when its task disappears (the step was ended).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from moe_launch.rundir import RunDir, node_name, write_json_atomic
from moe_launch.trainer.host_restore import HoldNewest, held_step
from moe_launch.trainer.start_phases import PROCESS_START_ENV, process_start_time

STANDBY_DIR = "standby"
STANDBY_ID_ENV = "MOE_LAUNCH_STANDBY_ID"  # the supervisor's id of the standby step, copied into its records
REFRESH_S = 1.0  # the standby rewrites its record this often
STALE_S = 10.0  # a record older than this is a dead or frozen standby
_POLL_S = 0.02
# the variables that make a process a given rank of a given step: a standby takes them over from its task
_RANK_ENV_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "SLURM_", "MOE_LAUNCH_")


def slot_name(node: str, local_rank: int) -> str:
    return f"{node}-l{local_rank}"


def local_rank_of(environ: Mapping[str, str]) -> int:
    return int(environ.get("LOCAL_RANK", environ.get("SLURM_LOCALID", "0")))


def unusable(rec: Optional[dict[str, Any]], now: float, environ: Mapping[str, str], alive: bool) -> Optional[str]:
    """Why the standby of `rec` must not take over a task with `environ`, or None if it may. Pure."""
    if rec is None:
        return "no standby"
    if rec.get("state") != "ready":
        return f"standby pid {rec.get('pid')} is {rec.get('state')}"
    if not alive:
        return f"standby pid {rec.get('pid')} is gone"
    if now - float(rec.get("time", 0.0)) > STALE_S:
        return f"standby pid {rec.get('pid')} last reported {now - float(rec.get('time', 0.0)):.0f} s ago"
    if rec.get("cuda_visible") != environ.get("CUDA_VISIBLE_DEVICES"):
        return (f"standby pid {rec.get('pid')} sees GPUs {rec.get('cuda_visible')!r}, this task "
                f"{environ.get('CUDA_VISIBLE_DEVICES')!r}")
    return None


def pid_alive(pid: int) -> bool:
    """Running (not a zombie waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def _read(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ---- the launched task's side -------------------------------------------------------------------------------------

def hand_over(run_dir: Path, attempt: int, environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """In a launched trainer task: hand this task's rank to the ready standby of its slot and mirror it until it
    ends; returns its exit code. None: no usable standby (the reason is printed if there was one), train here."""
    sdir = Path(run_dir) / STANDBY_DIR
    slot = slot_name(node_name(), local_rank_of(environ))
    rec = _read(sdir / f"{slot}.json")
    if rec is None:
        return None
    pid = int(rec.get("pid", -1))
    why = unusable(rec, time.time(), environ, pid_alive(pid))
    if why is not None:
        print(f"[trainer] standby {slot} not used: {why}; starting cold", flush=True)
        if pid_alive(pid) and rec.get("state") == "ready":  # an idle standby would hold this node's memory
            os.kill(pid, signal.SIGKILL)
        return None
    go = {"attempt": attempt, "pid": os.getpid(), "process_start": process_start_time(),
          "env": {k: v for k, v in environ.items() if k.startswith(_RANK_ENV_PREFIXES)}}
    try:
        fd = os.open(sdir / f"{slot}.go.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        print(f"[trainer] standby {slot} was claimed by another task; starting cold", flush=True)
        return None
    with os.fdopen(fd, "w") as f:
        json.dump(go, f)
    print(f"[trainer] rank {environ.get('RANK', environ.get('SLURM_PROCID'))} handed to the warm standby {slot} "
          f"(pid {pid}; its output: logs/standby-*)", flush=True)
    return _mirror(pid, sdir / f"{slot}.exit.json")


def _mirror(pid: int, exit_path: Path) -> int:
    def forward(signum, _frame) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, forward)
    while pid_alive(pid):
        time.sleep(_POLL_S)
    rec = _read(exit_path)
    if rec is None:  # it died without a word (SIGKILL, OOM killer): die the same way for srun / the supervisor
        os.kill(os.getpid(), signal.SIGKILL)
    return int(rec["code"])


# ---- the standby's side -------------------------------------------------------------------------------------------

def serve(cfg: Any, run_dir: RunDir, run_trainer: Callable[..., int]) -> int:
    """The standby process: get warm, announce, wait for a claim, then become that rank: `run_trainer(cfg, run_dir,
    attempt, model=...)` with the task's rank environment. Returns the trainer's exit code."""
    from moe_launch.trainer.dist import detect_env, pick_device

    env = detect_env(os.environ)  # the standby's own launch: only its local rank (its GPU) matters
    device = pick_device(env)
    sdir = run_dir.root / STANDBY_DIR
    sdir.mkdir(parents=True, exist_ok=True)
    slot = slot_name(node_name(), env.local_rank)
    for stale in (f"{slot}.go.json", f"{slot}.exit.json"):  # an earlier standby's, on this slot
        (sdir / stale).unlink(missing_ok=True)
    record = {"pid": os.getpid(), "node": node_name(), "local_rank": env.local_rank, "state": "starting",
              "id": os.environ.get(STANDBY_ID_ENV), "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    write_json_atomic(sdir / f"{slot}.json", {**record, "time": time.time()})  # this slot's record is now ours
    model = warm_model(cfg, device)
    holder = HoldNewest(run_dir.checkpoints)  # the newest checkpoint, verified and in host memory
    record.update(state="ready", prebuilt=model is not None)
    stop = threading.Event()

    def refresh() -> None:
        while True:
            write_json_atomic(sdir / f"{slot}.json", {**record, "time": time.time(), "held_step": held_step()})
            if stop.wait(REFRESH_S):
                return

    refresher = threading.Thread(target=refresh, daemon=True, name="standby-record")
    refresher.start()
    print(f"[standby] {slot} ready (model {'built and compiled' if model is not None else 'built at hand-over'})",
          flush=True)
    go_path = sdir / f"{slot}.go.json"
    go = None
    while go is None:
        time.sleep(_POLL_S)
        go = _read(go_path) if go_path.exists() else None
    stop.set()
    holder.stop()
    refresher.join()
    write_json_atomic(sdir / f"{slot}.json", {**record, "state": "taken", "time": time.time(),
                                                   "by": go["pid"], "held_step": held_step()})
    _become(go)
    code = 1
    try:
        code = run_trainer(cfg, run_dir, int(go["attempt"]), model=model)
    finally:
        write_json_atomic(sdir / f"{slot}.exit.json", {"code": code})
    return code


def _become(go: dict[str, Any]) -> None:
    """Take over the task's rank environment and process start; die with the task."""
    for key in [k for k in os.environ if k.startswith(_RANK_ENV_PREFIXES)]:
        del os.environ[key]
    os.environ.update(go["env"])
    os.environ[PROCESS_START_ENV] = str(go["process_start"])
    task = int(go["pid"])

    def watch() -> None:
        while pid_alive(task):
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)  # the step was ended: nothing of this attempt may go on

    threading.Thread(target=watch, daemon=True, name="standby-task-watch").start()
    print(f"[standby] now rank {os.environ.get('RANK', os.environ.get('SLURM_PROCID'))} of attempt {go['attempt']}",
          file=sys.stderr, flush=True)


def warm_model(cfg: Any, device: Any) -> Any:
    """The model the Trainer would build (same seed, recompute, compile, parameter dtype), after one forward/backward
    on made-up tokens of the training micro-batch shape: Dynamo traces, Inductor compiles (or loads from the run
    directory's cache) and the Triton kernels JIT-compile now rather than in the first step. Nothing of the model
    changes: no optimizer step, gradients dropped, buffers restored. None when the model depends on the rank
    (expert or pipeline parallelism): the Trainer builds it after the hand-over."""
    import torch

    from moe_launch.trainer.compile import compile_enabled, compile_model
    from moe_launch.trainer.dtypes import cast_parameters, compute_dtype, param_dtype, set_determinism
    from moe_launch.trainer.model import build_model
    from moe_launch.trainer.recompute import apply_recompute

    t, p = cfg.train, cfg.parallel
    if p.ep > 1 or p.pp > 1:
        return None
    set_determinism(t.deterministic, device)
    dtype = compute_dtype(t.dtype, device)
    torch.manual_seed(t.seed)  # as the Trainer does right before building: the same initial weights
    model = build_model(cfg.model, 0, 1, device)
    if t.recompute:
        apply_recompute(model, t.recompute)
    if compile_enabled(t.compile, device):
        compile_model(model)
    cast_parameters(model, param_dtype(t.param_dtype, dtype))
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    gen = torch.Generator(device="cpu").manual_seed(0)  # not the global generator: the run's draws stay the same
    tokens_BL = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)
    tokens_BL = tokens_BL.to(device)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss, _ = model.compute_loss(tokens_BL[:, :-1], tokens_BL[:, 1:])
    loss.backward()
    with torch.no_grad():
        for p_ in model.parameters():
            p_.grad = None
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-up's activations: leave the memory to whoever needs it until the go
    return model
