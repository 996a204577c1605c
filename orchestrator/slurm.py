"""Thin wrappers around the Slurm CLI: the login side (partition facts, sbatch, job state) and, inside the allocation,
trainer steps and probe steps (`srun`; its argv comes from srun.py, the one srun builder) and the allocation's
current node list (`scontrol show job`, never $SLURM_JOB_NODELIST: a failed node leaves a --no-kill allocation while
the variable still names it).

Every call takes an argument list and a timeout. Parsers are pure and tested on captured output. Answers that say the
controller cannot be reached (a slurmctld restart or failover) are not errors of the call: callers give a retry window
(cluster.controller_retry_s) over which such calls are repeated with backoff.

Why not submitit here (it submits `moe-data prepare`'s job arrays, trainer/data/runners.py): the allocation is a
rendered batch script that a user can also submit by hand (`--render-sbatch`), not a pickled Python call; the
supervisor needs `scontrol`'s live node list of a `--no-kill` job, which submitit does not expose; and a job state
must tell "the controller did not answer" from "the job is gone", which submitit's cached sacct poll folds into one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

from moe_launch.conf.schema import ClusterConfig
from moe_launch.errors import SubmissionError
from moe_launch.orchestrator.backend import StepResult
from moe_launch.orchestrator.plan import PartitionInfo
from moe_launch.orchestrator.srun import srun_argv

_TIMEOUT_S = 30.0
_BAD_STATES = ("down", "drain", "fail", "inval", "maint", "unknown", "future", "powered_down", "not_responding")
_TASK_LINE = re.compile(r"^srun: error: (\S+): tasks? [\d,\-]+: (.*)$")
_NODE_FAILURE = re.compile(r"Node failure on (\S+)")
# a step that cannot start its tasks on a node (its slurmd is dead) says so once, naming the node
_LAUNCH_FAILED = re.compile(r"Task launch for \S+ failed on node ([^\s:]+)")
_CONTROLLER_DOWN = (
    "Unable to contact slurm controller", "Socket timed out on send/recv", "Zero Bytes were transmitted or received",
    "slurmctld not responding", "Transport endpoint is not connected", "Connection refused",
)
# step creation refused while an earlier step of the job still holds the resources (it is being cancelled, or its
# cancel waits for the controller): the step is started again, like after a controller error
_STEP_BUSY = ("Memory required by task is not available", "Requested nodes are busy",
              "Job step creation temporarily disabled")
_BACKOFF_MAX_S = 15.0
_EXIT_CODE = re.compile(r"Exited with exit code (\d+)")
_PROBE_TIMEOUT_S = 4.0  # a live slurmd starts a probe step in well under a second; a dead one never does
# before a spare is swapped in: a wrong "dead" costs a healthy node, so a loaded machine gets more time
SWAP_PROBE_TIMEOUT_S = 15.0
_STRAGGLER_EXIT_S = 60.0


def is_controller_error(text: str) -> bool:
    """Does a Slurm client's output say that the controller could not be reached (transient) rather than no?"""
    return any(marker in text for marker in _CONTROLLER_DOWN)


def backoff_delays(window_s: float, first_s: float = 1.0) -> list[float]:
    """Pure: the waits between attempts of a call retried over `window_s` (doubling, at most _BACKOFF_MAX_S)."""
    delays, total, d = [], 0.0, first_s
    while total + d <= window_s:
        delays.append(d)
        total += d
        d = min(2 * d, _BACKOFF_MAX_S)
    return delays


def _run(argv: list[str], timeout: float = _TIMEOUT_S, check: bool = True,
         retry_s: float = 0.0) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client. While it answers that the controller cannot be reached (or hangs), try again with backoff
    for up to `retry_s` seconds; only then does that count as a failure."""
    for delay in [*backoff_delays(retry_s), None]:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            if delay is None:
                raise SubmissionError(f"`{' '.join(argv)}` failed: {e}. Is slurmctld up (`scontrol ping`)?") from e
            time.sleep(delay)
            continue
        except OSError as e:
            raise SubmissionError(f"`{' '.join(argv)}` failed: {e}. Is Slurm installed (`sinfo`)?") from e
        if proc.returncode == 0 or delay is None or not is_controller_error(proc.stderr + proc.stdout):
            break
        time.sleep(delay)
    if check and proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-800:]
        raise SubmissionError(f"`{' '.join(argv)}` exited {proc.returncode}: {tail}")
    return proc


def hostnames(nodelist: str, retry_s: float = 0.0) -> tuple[str, ...]:
    """Expand a Slurm node list (node[1-3],gpu7) the way Slurm does."""
    if not nodelist or nodelist == "(null)":
        return ()
    return tuple(_run(["scontrol", "show", "hostnames", nodelist], retry_s=retry_s).stdout.split())


# ---- pure parsers -------------------------------------------------------------------------------------------------

def parse_time_limit(text: str) -> Optional[int]:
    """sinfo %l ("infinite", "30:00", "1:00:00", "2-00:00:00") -> minutes, None for unlimited."""
    text = text.strip()
    if text in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)  # mm:ss -> 0:mm:ss
    h, m, s = parts
    return (int(days or 0) * 24 + h) * 60 + m + (1 if s else 0)


def parse_job_field(text: str, key: str) -> Optional[str]:
    """A `Key=value` field of `scontrol show job` output (NodeList, not ReqNodeList/ExcNodeList)."""
    m = re.search(rf"(?<![A-Za-z]){key}=(\S+)", text)
    return m.group(1) if m else None


def is_bad_state(state: str) -> bool:
    s = state.lower()
    return s.endswith("*") or any(b in s for b in _BAD_STATES)


def parse_srun_line(line: str) -> Optional[tuple[str, str, str]]:
    """One srun stderr line -> ("node_failure", node, line) | ("exit", node, code) | ("signal", node, what) | None.
    A node failure is Slurm's verdict on a node, or a task launch that failed there."""
    line = line.strip()
    m = _NODE_FAILURE.search(line) or _LAUNCH_FAILED.search(line)
    if m and line.startswith("srun: error:"):
        return ("node_failure", m.group(1), line)
    m = _TASK_LINE.match(line)
    if m:
        node, what = m.groups()
        code = _EXIT_CODE.search(what)
        return ("exit", node, code.group(1)) if code else ("signal", node, what)
    return None


# ---- login side ---------------------------------------------------------------------------------------------------

def partition_info(name: Optional[str], retry_s: float = 0.0) -> Optional[PartitionInfo]:
    """Facts about `name` (None: the default partition); None if it does not exist."""
    rows = [ln.split("|") for ln in _run(["sinfo", "-h", "-a", "-o", "%P|%l"], retry_s=retry_s).stdout.splitlines()
            if "|" in ln]
    chosen = None
    for part, limit in rows:
        is_default = part.endswith("*")
        if (name is None and is_default) or part.rstrip("*") == name:
            chosen = (part.rstrip("*"), limit)
            break
    if chosen is None:
        return None
    out = _run(["sinfo", "-h", "-N", "-p", chosen[0], "-o", "%N %T"], retry_s=retry_s).stdout
    states: dict[str, str] = {}
    for line in out.splitlines():
        node, _, state = line.partition(" ")
        states.setdefault(node, state.strip())
    return PartitionInfo(name=chosen[0], nodes=tuple(states), max_time_min=parse_time_limit(chosen[1]),
                         unavailable=tuple(n for n, s in states.items() if is_bad_state(s)))


def submit(script: Path, retry_s: float = 0.0) -> str:
    out = _run(["sbatch", "--parsable", str(script)], retry_s=retry_s).stdout.strip()
    job_id = out.split(";")[0]
    if not job_id.isdigit():
        raise SubmissionError(f"sbatch answered {out!r} instead of a job id")
    return job_id


def job_state(job_id: str, retry_s: float = 0.0) -> str:
    """PENDING / RUNNING / COMPLETED / NODE_FAIL / ... ; '' if Slurm no longer knows the job. While the controller
    cannot be reached this waits (up to retry_s): "no answer" must never read as "the job is gone"."""
    proc = _run(["scontrol", "show", "job", "-o", job_id], check=False, retry_s=retry_s)
    if proc.returncode != 0 and is_controller_error(proc.stderr):
        raise SubmissionError(f"slurmctld unreachable for {retry_s:.0f} s (cluster.controller_retry_s): "
                              f"{proc.stderr.strip()[-300:]}")
    state = parse_job_field(proc.stdout, "JobState") if proc.returncode == 0 else None
    if state:
        return state
    proc = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], check=False, retry_s=retry_s)
    words = proc.stdout.split()
    return words[0] if proc.returncode == 0 and words else ""


def cancel(job_id: str, signal_name: Optional[str] = None, retry_s: float = 0.0,
           if_state: Optional[str] = None) -> None:
    """if_state: cancel only a job in that state (scancel --state), so a job that just started is left alone."""
    _run(["scancel", *([f"--signal={signal_name}"] if signal_name else []),
          *([f"--state={if_state}"] if if_state else []), job_id], check=False, retry_s=retry_s)


# ---- inside the allocation ------------------------------------------------------------------------------------------

def probe_argv(job_id: str, node: str) -> list[str]:
    """Pure: the probe step on `node` (--overlap: it must not queue behind the trainer step holding the CPUs)."""
    return srun_argv([node], 1, "moe-probe", job_id=job_id, overlap=True) + ["echo", "moe-probe-ok"]


def step_argv(job_id: str, nodes: tuple[str, ...], name: str, cluster: ClusterConfig) -> list[str]:
    """Pure: the srun prefix of a trainer step. --overlap: the step of a failed node can linger until Slurm's node
    timeout; the next step does not wait for its CPUs."""
    return srun_argv(nodes, cluster.tasks_per_node, name, job_id=job_id, overlap=True,
                     cpus_per_task=cluster.cpus_per_task, gpus_per_node=cluster.gpus_per_node, kill_on_bad_exit=True)


def probe_nodes(job_id: str, nodes: tuple[str, ...], timeout_s: float) -> set[str]:
    """The nodes among `nodes` that run a trivial step within timeout_s (in parallel). Slurm's own verdict on a dead
    node takes its node timeout (~25-30 s here); a step launch on it simply never succeeds. A probe that could not
    reach the controller says nothing about its node, which then counts as alive."""
    procs = {n: subprocess.Popen(probe_argv(job_id, n), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
             for n in nodes}
    deadline = time.monotonic() + timeout_s
    alive: set[str] = set()
    silent: set[str] = set()
    for node, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if b"moe-probe-ok" in out or is_controller_error(err.decode(errors="replace")):
                alive.add(node)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            silent.add(node)
    if silent and not controller_answers():
        alive |= silent  # the probes were waiting for the controller, not for their nodes
    return alive


def controller_answers() -> bool:
    try:
        return "is UP" in _run(["scontrol", "ping"], timeout=10.0, check=False).stdout
    except SubmissionError:
        return False


class SlurmStep:
    """One `srun` trainer step. Reads srun's stderr as it comes: task exits and node failures are seen at once, and
    nodes whose tasks never report after another task's bad exit count as dead after supervisor.exit_grace_s
    (their slurmstepd died with the node; srun itself would wait for Slurm's node timeout). An srun that could not
    create the step because the controller was unreachable is started again, with backoff, for up to
    cluster.controller_retry_s: that is no failure of the trainer or of a node."""

    def __init__(self, job_id: str, nodes: tuple[str, ...], attempt: int, argv: list[str], env: dict[str, str],
                 cluster: ClusterConfig, log_dir: Path, grace_s: float):
        self.job_id, self.nodes, self.attempt, self.grace_s = job_id, nodes, attempt, grace_s
        self.name = f"moe-attempt-{attempt}"
        self.retry_s = cluster.controller_retry_s
        self.retry_delays = backoff_delays(cluster.controller_retry_s)
        self.respawn_at: Optional[float] = None
        penv = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        penv.update(env)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log_dir / "srun.log", "ab")
        self.argv, self.env = step_argv(job_id, nodes, self.name, cluster) + list(argv), penv
        self._spawn()
        self.dead: list[str] = []
        self.reported: dict[str, str] = {}
        self.first_bad: Optional[tuple[str, str, str]] = None
        self.first_bad_t: Optional[float] = None
        self.killed = False
        self.probed = False

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.lines: list[str] = []
        self.arrived: list[float] = []  # monotonic arrival time of each line (the grace counts from the line)
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        self._seen = 0

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            self.log.write(time.strftime("%H:%M:%S ").encode() + raw)  # arrival time: detection latency is visible
            self.log.flush()
            self.arrived.append(time.monotonic())
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def _consume(self) -> None:
        while self._seen < len(self.lines):
            parsed = parse_srun_line(self.lines[self._seen])
            arrived = self.arrived[self._seen]
            self._seen += 1
            if parsed is None:
                continue
            kind, node, what = parsed
            if kind == "node_failure":
                self.dead.append(node)
                continue
            self.reported.setdefault(node, what)
            bad = kind == "signal" or what != "0"
            if bad and self.first_bad is None:
                self.first_bad, self.first_bad_t = parsed, arrived

    def poll(self) -> Optional[StepResult]:
        if self.respawn_at is not None and not self.killed:
            if time.monotonic() < self.respawn_at:
                return None
            self.respawn_at = None
            self._spawn()
        rc = self.proc.poll()
        if rc is not None:
            self._reader.join(timeout=2.0)
        self._consume()
        if rc is not None and self._controller_refused() and self.retry_delays and not self.killed:
            self.log.write(f"{time.strftime('%H:%M:%S')} moe-launch: controller unreachable or step refused for "
                           f"now, srun again in {self.retry_delays[0]:.0f} s\n".encode())
            self.respawn_at = time.monotonic() + self.retry_delays.pop(0)
            return None
        missing = tuple(n for n in self.nodes if n not in self.reported)
        if rc is None:
            if self.dead:
                return self._kill_with(self._result(None, ()))
            if self.first_bad is not None and self.first_bad[0] == "signal":
                # tasks killed from outside: that node is the cause, the others are collateral
                return self._kill_with(self._result(None, ()))
            waited = time.monotonic() - self.first_bad_t if self.first_bad_t is not None else 0.0
            if waited > self.grace_s and missing and not self.probed:
                # silent after another task failed: a dead slurmstepd, or a task slow to exit? ask the nodes
                self.probed = True
                gone = tuple(n for n in missing if n not in probe_nodes(self.job_id, missing, _PROBE_TIMEOUT_S))
                if gone:
                    return self._kill_with(self._result(None, gone))
            if waited > self.grace_s + _STRAGGLER_EXIT_S:
                # every node answers, yet the tasks do not end: a failure without a node cause
                return self._kill_with(self._result(None, ()))
            return None
        return self._result(rc, ())

    def _controller_refused(self) -> bool:
        """srun ended without any task reporting, saying the controller could not be reached or the job's resources
        are still held by an earlier step: the step never ran."""
        text = "\n".join(self.lines)
        return (not self.reported and not self.dead
                and (is_controller_error(text) or any(marker in text for marker in _STEP_BUSY)))

    def _kill_with(self, result: StepResult) -> StepResult:
        self.kill()
        return result

    def _result(self, rc: Optional[int], silent: tuple[str, ...]) -> StepResult:
        dead = list(dict.fromkeys(self.dead + list(silent)))
        code = 0
        detail = []
        if self.first_bad:
            kind, node, what = self.first_bad
            code = int(what) if kind == "exit" else 137
            seen = time.monotonic() - (self.first_bad_t or time.monotonic())
            detail.append(f"first bad exit: {node} ({'exit code ' + what if kind == 'exit' else what}), "
                          f"reported {seen:.1f} s before this verdict")
            if kind == "signal" and node not in dead and not self.dead:
                # its tasks were killed from outside the program: treat the node as failed, unless another node's
                # failure explains it (srun then kills the peers' tasks, and reports them as killed)
                dead.append(node)
        elif rc:
            code = rc
            detail.append(f"srun exit {rc}: " + " | ".join(self.lines[-3:]))
        if self.dead:
            detail.append("srun: node failure on " + ", ".join(self.dead))
        if silent:
            detail.append(f"{', '.join(silent)}: no task exit reported and no answer to a probe step")
        if dead and not code:
            code = 137
        failed = tuple(n for n, w in self.reported.items() if w not in ("0",) and n not in dead)
        return StepResult(code=code, dead_nodes=tuple(dead), failed_nodes=failed, detail="; ".join(detail))

    def _step_id(self, retry_s: float = 0.0) -> Optional[str]:
        out = _run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"], check=False, retry_s=retry_s).stdout
        for line in out.splitlines():
            sid, _, name = line.partition(" ")
            if name.strip() == self.name:
                return sid
        return None

    def terminate(self, signal_name: str = "USR2") -> None:
        sid = self._step_id()
        if sid:
            _run(["scancel", f"--signal={signal_name}", sid], check=False)

    def kill(self) -> None:
        if self.killed:
            return
        self.killed = True
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # the step's tasks on live nodes outlive a killed srun: cancel the step, in the background, because
        # slurmctld may take many seconds to answer while it tries to reach a dead node, and the relaunch must not wait
        threading.Thread(target=self._cancel_step, daemon=True, name=f"cancel-{self.name}").start()

    def _cancel_step(self) -> None:
        try:
            # with retries: tasks left on live nodes hold the job's memory until the step is cancelled, and a
            # relaunch's step cannot start before
            sid = self._step_id(self.retry_s)
            if sid:
                _run(["scancel", "--signal=KILL", sid], check=False, retry_s=self.retry_s)
                _run(["scancel", sid], check=False, retry_s=self.retry_s)
        except SubmissionError:
            pass  # the allocation's end reaps whatever is left

    def wait(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False


class SlurmCluster:
    kind = "slurm"

    def __init__(self, job_id: str, cluster: ClusterConfig, grace_s: float):
        self.job_id, self.cfg, self.grace_s = job_id, cluster, grace_s
        self.order: tuple[str, ...] = ()

    def allocation(self) -> tuple[str, ...]:
        retry = self.cfg.controller_retry_s
        text = _run(["scontrol", "show", "job", "-o", self.job_id], retry_s=retry).stdout
        nodes = hostnames(parse_job_field(text, "NodeList") or "", retry_s=retry)
        if not self.order:
            self.order = nodes
        return nodes

    def unavailable(self, nodes: tuple[str, ...]) -> dict[str, str]:
        if not nodes:
            return {}
        now = set(self.allocation())
        out = _run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"], check=False).stdout
        states = dict(line.split(None, 1) for line in out.splitlines() if len(line.split()) == 2)
        bad = {n: s for n, s in states.items() if n in nodes and is_bad_state(s)}
        bad.update({n: "left the allocation" for n in nodes if n not in now})
        return bad

    def probe(self, nodes: tuple[str, ...]) -> set[str]:
        return probe_nodes(self.job_id, nodes, SWAP_PROBE_TIMEOUT_S) if nodes else set()

    def launch(self, nodes: tuple[str, ...], attempt: int, argv: list[str], env: dict[str, str],
               log_dir: Path) -> SlurmStep:
        return SlurmStep(self.job_id, nodes, attempt, argv, {**env, "MASTER_ADDR": self.master_addr(nodes)},
                         self.cfg, log_dir, self.grace_s)

    def master_addr(self, nodes: tuple[str, ...]) -> str:
        # srun places rank 0 on the step's first node in the allocation's order, not in --nodelist's order
        rank = {n: i for i, n in enumerate(self.order)}
        return min(nodes, key=lambda n: rank.get(n, len(rank)))
