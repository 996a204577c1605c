"""Where the tokenization tasks of `moe-data prepare` run: local processes or a Slurm job array (submitit).

Both show a rich progress bar on stderr (bytes of input tokenized, files and parts done, tokens/s overall and per
core, elapsed and remaining time); local workers report every finished file through a queue, so the bar moves per
file. Both let every task finish before reporting failures, so a rerun redoes only the parts that failed.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_launch.errors import DataError, SubmissionError
from moe_launch.trainer.data.prepare import PartTask, tokenize_part

if TYPE_CHECKING:
    from moe_launch.trainer.data.prepare import PrepareSpec

_SLURM_POLL_S = 2.0
_SLURM_RESUBMITS = 2


class _Bar:
    """Progress over the input bytes of the pending parts; a no-op when disabled."""

    def __init__(self, enabled: bool, tasks: list[PartTask], where: str):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.t0 = time.perf_counter()
        self.tokens = 0
        self.seconds = 0.0
        self.parts = 0
        self.n_parts = len(tasks)
        self.files = 0
        self.n_files = sum(len(t.files) for t in tasks)
        self.reported = {t.part: 0 for t in tasks}  # bytes already shown per part (file reports)
        self.part_files = {t.part: 0 for t in tasks}
        self.progress = Progress(
            TextColumn(f"[bold]tokenize ({where})"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[status]}"),
            TextColumn("elapsed"), TimeElapsedColumn(),
            TextColumn("left"), TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self.task = self.progress.add_task("tokenize", total=sum(t.nbytes for t in tasks) or 1, status=self._status())

    def _status(self) -> str:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        per_core = self.tokens / self.seconds if self.seconds else 0.0
        return (f"files {self.files}/{self.n_files}  parts {self.parts}/{self.n_parts}  {self.tokens / wall:,.0f} "
                f"tok/s  {per_core:,.0f} tok/s/core")

    def file_done(self, part: int, nbytes: int) -> None:
        self.files += 1
        self.part_files[part] += 1
        self.reported[part] += nbytes
        self.progress.update(self.task, advance=nbytes, status=self._status())

    def done(self, task: PartTask, record: dict[str, Any]) -> None:
        self.parts += 1
        self.tokens += record["tokens"]
        self.seconds += record["seconds"]
        # what file reports did not show (Slurm tasks report per part only)
        self.files += len(task.files) - self.part_files[task.part]
        self.progress.update(self.task, advance=task.nbytes - self.reported[task.part])
        self.part_files[task.part], self.reported[task.part] = len(task.files), task.nbytes
        self.progress.update(self.task, status=self._status())

    def __enter__(self) -> "_Bar":
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


def _raise_failures(failures: list[tuple[PartTask, BaseException]], n_tasks: int) -> None:
    if not failures:
        return
    task, exc = failures[0]
    raise DataError(
        f"{len(failures)} of {n_tasks} tokenization parts failed (first: part {task.part}, files "
        f"{task.files[0]}...: {exc}); the finished parts are kept: fix the cause and re-run the same command, "
        "which skips them"
    ) from exc


def run_local(tasks: list[PartTask], workers: int, progress: bool) -> list[dict[str, Any]]:
    """Tokenize in `workers` spawned processes (spawn: the caller may hold threads, e.g. a trainer's gloo group)."""
    records: list[dict[str, Any]] = []
    failures: list[tuple[PartTask, BaseException]] = []
    if not tasks:
        return records
    with _Bar(progress, tasks, f"{min(workers, len(tasks))} processes") as bar:
        if workers == 1 or len(tasks) == 1:
            for task in tasks:
                try:
                    records.append(tokenize_part(task, bar.file_done))
                    bar.done(task, records[-1])
                except Exception as exc:  # keep going: the other parts can still finish
                    failures.append((task, exc))
        else:
            context = multiprocessing.get_context("spawn")
            with context.Manager() as manager, \
                    ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=context) as pool:
                files_q = manager.Queue()
                futures = {pool.submit(tokenize_part, task, _QueueReport(files_q)): task for task in tasks}
                pending = set(futures)
                while pending:
                    finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    _drain(files_q, bar)
                    for future in finished:
                        try:
                            records.append(future.result())
                            bar.done(futures[future], records[-1])
                        except Exception as exc:
                            failures.append((futures[future], exc))
    _raise_failures(failures, len(tasks))
    return records


class _QueueReport:
    """Picklable per-file reporter for spawned workers: (part, bytes) onto a manager queue."""

    def __init__(self, q: Any):
        self.q = q

    def __call__(self, part: int, nbytes: int) -> None:
        self.q.put((part, nbytes))


def _drain(q: Any, bar: _Bar) -> None:
    while True:
        try:
            part, nbytes = q.get_nowait()
        except queue.Empty:
            return
        bar.file_done(part, nbytes)


def _is_lost(exc: BaseException) -> bool:
    """A task that never finished (node failure, preemption, cancelled) as opposed to one that raised."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    return isinstance(exc, UncompletedJobError) and not isinstance(exc, FailedJobError)


def run_slurm(tasks: list[PartTask], spec: "PrepareSpec", out_dir: Path) -> list[dict[str, Any]]:
    """One Slurm array task per part (at most `spec.workers` at once), submitted and watched through submitit.

    The output directory must be on a filesystem the compute nodes share; the tasks write parts and markers there.
    Parts whose task was lost (its node died, it was preempted) are resubmitted up to _SLURM_RESUBMITS times; a task
    that raised (bad input) is not, since it would fail the same way again.
    """
    if not tasks:
        return []
    import submitit

    executor = submitit.AutoExecutor(folder=out_dir / "slurm" / "%j", cluster="slurm")
    params: dict[str, Any] = {
        "name": "moe-data-prepare",
        "timeout_min": spec.slurm_time_min,
        "nodes": 1,
        "tasks_per_node": 1,
        "cpus_per_task": 1,
        "slurm_array_parallelism": spec.workers,
    }
    if spec.slurm_partition:
        params["slurm_partition"] = spec.slurm_partition
    executor.update_parameters(**params)
    records: list[dict[str, Any]] = []
    failures: list[tuple[PartTask, BaseException]] = []
    todo = list(tasks)
    with _Bar(spec.progress, tasks, "slurm array") as bar:
        for attempt in range(_SLURM_RESUBMITS + 1):
            try:
                jobs = executor.map_array(tokenize_part, todo)
            except Exception as exc:
                raise SubmissionError(
                    f"sbatch refused the tokenization array ({exc}); check --partition and the cluster"
                ) from exc
            waiting, lost = dict(zip(todo, jobs)), []
            while waiting:
                for task, job in list(waiting.items()):
                    if not job.done():
                        continue
                    del waiting[task]
                    try:
                        records.append(job.result())
                        bar.done(task, records[-1])
                    except Exception as exc:  # submitit attaches the task's stderr tail
                        (lost if _is_lost(exc) and attempt < _SLURM_RESUBMITS else failures).append((task, exc))
                if waiting:
                    time.sleep(_SLURM_POLL_S)
            todo = [task for task, _exc in lost]
            if not todo:
                break
    _raise_failures(failures, len(tasks))
    return records
