"""Session fixtures of the fault suite: one uninterrupted reference run, computed once and shared by every test."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RUN_TIMEOUT_S, assert_nothing_lost, finish, overrides, start, tree_digest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NUMERICS_SOURCES = ("trainer", "conf", "kernels")  # code whose edits can change the trained bits


def source_digest() -> str:
    h = hashlib.sha256()
    for top in NUMERICS_SOURCES:
        for p in sorted((REPO / top).rglob("*.py")):
            h.update(str(p.relative_to(REPO)).encode() + p.read_bytes())
    return h.hexdigest()


class Reference:
    """The uninterrupted run of the suite's config. `run_dir` is recomputed if the trainer's source changed since
    (several engineers edit one working tree; in CI the tree is fixed and it is computed exactly once)."""

    def __init__(self, root: Path):
        self.root, self.count = root, 0
        self.digest: dict[str, str] = {}
        self.code = ""
        self._dir: Path | None = None

    @property
    def run_dir(self) -> Path:
        if self._dir is None or self.code != source_digest():
            self._compute()
        assert self._dir is not None
        return self._dir

    def _compute(self) -> None:
        self.code = source_digest()
        name = f"reference{self.count}"
        self.count += 1
        # CPU results depend on the thread count, and the suite's autouse one-thread fixture is function-scoped (not
        # active yet when a session fixture runs): pin it here too, or the reference differs in the last bits
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMP_NUM_THREADS", "1")
            mp.setenv("MKL_NUM_THREADS", "1")
            proc, rd = start(self.root, name, *overrides(buffers=0))
            code, summary, records = finish(proc, self.root, name, RUN_TIMEOUT_S)
        assert code == 0 and summary["status"] == "completed" and summary["restarts"] == 0, summary
        assert_nothing_lost(rd, records)
        self._dir, self.digest = rd, tree_digest(rd)


@pytest.fixture(scope="session")
def reference(slurm_cluster, tmp_path_factory) -> Reference:
    ref = Reference(tmp_path_factory.mktemp("faults-reference"))
    ref.run_dir  # noqa: B018 — computed up front, so the first fault test's timing is its own
    return ref
