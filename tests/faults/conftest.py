"""Session fixtures of the fault suite: one uninterrupted reference run, computed once and shared by every test."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RUN_TIMEOUT_S, assert_nothing_lost, finish, overrides, start, tree_digest  # noqa: E402


@dataclass(frozen=True)
class Reference:
    root: Path  # tmp folder holding runs/reference (fault runs go to their own tmp_path)
    run_dir: Path
    digest: dict[str, str]  # sha256 of every file of the reference run, to prove later runs never touch it


@pytest.fixture(scope="session")
def reference(slurm_cluster, tmp_path_factory) -> Reference:
    root = tmp_path_factory.mktemp("faults-reference")
    # CPU results depend on the thread count, and the suite's autouse one-thread fixture is function-scoped (it is
    # not active yet while a session fixture runs): pin it here too, or the reference differs in the last bits
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("MKL_NUM_THREADS", "1")
        proc, rd = start(root, "reference", *overrides(buffers=0))
        code, summary, records = finish(proc, root, "reference", RUN_TIMEOUT_S)
    assert code == 0 and summary["status"] == "completed" and summary["restarts"] == 0, summary
    assert_nothing_lost(rd, records)
    return Reference(root=root, run_dir=rd, digest=tree_digest(rd))
