"""The run-directory contract shared by the orchestrator, the trainer and the health checks.

runs/<name>/
  config.yaml        resolved config (written by the login side, read by every rank)
  journal.jsonl      one JSON event per line: time, kind, nodes, details (supervisor, login side, trainer rank 0)
  metrics.jsonl      one line per logged step (trainer rank 0)
  heartbeat/         rank<r>.json per rank: step, time, host, pid (hang detection)
  faults/            <host>-rank<r>-step<s>.json fault records (NaN/Inf, ...)
  checkpoints/       ckpt-a, ckpt-b (dual alternating), model-step-N (persistent, model only)
  health/            preflight results and raw outputs
  logs/              per-attempt trainer logs
  summary.json       written at the end: status, steps_done, final_loss, restarts, swapped_nodes, excluded_nodes, wall_s
"""

from __future__ import annotations

import errno
import functools
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

# Trainer exit codes: the supervisor's contract (documented in the README).
EXIT_OK = 0
EXIT_CONFIG = 2  # bad config or data: relaunching cannot help
EXIT_SOFT_FAULT = 3  # NaN/Inf on this rank; a fault record names host, rank, step
EXIT_PREEMPTED = 4  # SIGUSR2/SIGTERM received: a checkpoint was written, resubmit to continue
EXIT_CHECKPOINT = 5  # no usable checkpoint / checkpoint mismatch
EXIT_ROLLBACK = 6  # training spike: relaunch; the trainer restarts from the model checkpoint named in rollback.json
EXIT_SPIKE = 7  # training spike the trainer cannot roll back from (or that recurred): a data/model problem, stop
EXIT_CHECKPOINT_WRITE = 8  # checkpoints kept failing to persist (ENOSPC, EIO, read-only FS): fix storage

JOURNAL_KINDS = (
    "start", "allocation", "preflight", "launch", "failure", "exclude", "swap", "resume", "straggler",
    "checkpoint", "fault", "spike", "skew", "stop", "done", "resubmit", "attach", "info",
)


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def journal(self) -> Path:
        return self.root / "journal.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def evals(self) -> Path:
        return self.root / "eval.jsonl"

    @property
    def heartbeat(self) -> Path:
        return self.root / "heartbeat"

    @property
    def faults(self) -> Path:
        return self.root / "faults"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def health(self) -> Path:
        return self.root / "health"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    def make(self) -> "RunDir":
        for d in (self.heartbeat, self.faults, self.checkpoints, self.health, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        return self


def node_name(env: Optional[Mapping[str, str]] = None) -> str:
    """This process's node, as the scheduler names it. The one way every writer names a node (fault records,
    heartbeats, the journal, health results, the supervisor's host), so each name matches the allocation's node list.

    Hostnames often differ from Slurm's NodeNames (`node4.hpc.example` vs `node4`): inside Slurm the hostname is used
    only to look the NodeName up. Order: MOE_LAUNCH_NODE (cluster=local runs several "nodes" on one host),
    SLURMD_NODENAME (set in every Slurm task and batch script), the node whose NodeHostName/NodeAddr is this host
    (inside an allocation without that variable), the hostname (outside Slurm)."""
    env = os.environ if env is None else env
    named = env.get("MOE_LAUNCH_NODE") or env.get("SLURMD_NODENAME")
    if named:
        return named
    host = socket.gethostname()
    if env.get("SLURM_JOB_ID"):
        return _slurm_node_of_host(host) or host
    return host


@functools.lru_cache(maxsize=None)
def _slurm_node_of_host(host: str) -> Optional[str]:
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return slurm_node_of_host(out, host)


def slurm_node_of_host(scontrol_nodes: str, host: str) -> Optional[str]:
    """The NodeName of `scontrol show node -o` output whose NodeHostName or NodeAddr is `host` (or its short form)."""
    wanted = {host, host.split(".")[0]}
    for line in scontrol_nodes.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if wanted & {fields.get("NodeHostName"), fields.get("NodeAddr")}:
            return fields.get("NodeName")
    for line in scontrol_nodes.splitlines():  # no host field matched: a NodeName equal to the short hostname
        name = dict(f.split("=", 1) for f in line.split() if "=" in f).get("NodeName")
        if name in wanted:
            return name
    return None


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line. A single O_APPEND write keeps lines whole when several processes append. A file whose
    last line was torn (a writer died, or the disk filled, mid-write) gets a newline first, so the torn line never
    swallows this record; a short write (disk full) raises ENOSPC naming the file."""
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        if os.write(fd, line) < len(line):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    finally:
        os.close(fd)


def journal_event(run_dir: Path | RunDir, kind: str, nodes: Iterable[str] = (), **details: Any) -> dict[str, Any]:
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
    if kind not in JOURNAL_KINDS:
        raise ValueError(f"unknown journal kind {kind!r}; known: {JOURNAL_KINDS}")
    event = {"time": time.time(), "kind": kind, "nodes": list(nodes), "details": details}
    append_jsonl(rd.journal, event)
    return event


_TORN_WARNED: set[tuple[str, int]] = set()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSON-lines file, skipping torn lines (a writer killed, or the disk full, mid-write) with a warning on
    stderr, once per line."""
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines()):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if (str(path), i) not in _TORN_WARNED:
                _TORN_WARNED.add((str(path), i))
                print(f"warning: {path} line {i + 1} is torn (its writer died or the disk filled mid-write); "
                      f"skipped: {line[:80]!r}", file=sys.stderr)
    return out


def write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
