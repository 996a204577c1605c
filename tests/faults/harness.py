"""Fault-injection harness: one tiny deterministic `moe-launch cluster=slurm` config, an uninterrupted reference run,
and the checks every fault test makes (bitwise-equal final state, journal story, summary counts, nothing lost).

Runs use node3..node6 (cluster.exclude=[node1,node2]) so the other suites' tests on node1/node2 are disturbed less.
The final model and optimizer state is read from the newest verifying checkpoint slot: the trainer always writes a
full checkpoint at the last step, so that slot IS the final state.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

TESTS = Path(__file__).resolve().parents[1]
for extra in (TESTS, TESTS / "orchestrator"):  # e2e_util lives beside the orchestrator's own e2e tests
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from e2e_util import finish, metrics_step, start, wait_for  # noqa: E402

from moe_launch.rundir import read_jsonl  # noqa: E402
from moe_launch.trainer.checkpoint.store import SLOTS, read_manifest, verify  # noqa: E402

STEPS = 12
CKPT_EVERY = 3
MODEL_CKPT_EVERY = 6  # persistent model-step-N checkpoints: none of them may be lost by any fault
FAULT_NODES = ("node3", "node4", "node5", "node6")
RUN_TIMEOUT_S = 480
# timing only (train.step_sleep_s never changes the numbers): an idle machine runs a step in ~0.3 s, too fast to hit
# "mid-run" from outside; tests that inject from outside slow the steps so the run is still going when they strike
SLOW = "train.step_sleep_s=1"

# Everything that decides the numbers: identical in the reference and in every fault run.
NUMERICS = [
    "train.deterministic=true", f"train.steps={STEPS}", "train.seq_len=32", "train.micro_batch_size=1",
    "train.global_batch_size=2", f"train.ckpt_interval={CKPT_EVERY}", f"train.model_ckpt_interval={MODEL_CKPT_EVERY}",
    "train.progress=false",
]
# Where and how it runs: free to differ per fault (node choice, buffers, timeouts) without touching the numbers.
PLACEMENT = ["cluster=slurm", "cluster.nodes=2", "cluster.exclude=[node1,node2]", "health.preflight=false",
             "supervisor.poll_s=0.2", "supervisor.max_restarts=3"]


def overrides(buffers: int = 1, *extra: str) -> list[str]:
    # a fresh health store per run: faults injected into one test must not quarantine nodes for the next (the
    # supervisor records in-run blame in the store, which quarantines a node after repeated failures)
    store = tempfile.mkdtemp(prefix="moe-faults-health-")
    return [*PLACEMENT, f"cluster.buffers={buffers}", f"health.store_dir={store}", *NUMERICS, *extra]


def journal(rd: Path) -> list[dict[str, Any]]:
    return read_jsonl(rd / "journal.jsonl")


def launches(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "launch"]


def wait_launch(rd: Path, timeout: float = 180) -> dict[str, Any]:
    """The first launch record (its action names nodes and buffers)."""
    return wait_for(lambda: (launches(journal(rd)) or [None])[0], timeout, "the first launch")


def wait_step(rd: Path, step: int, timeout: float = 240) -> None:
    wait_for(lambda: metrics_step(rd) >= step, timeout, f"step {step}")


def wait_checkpoint(rd: Path, step: int, timeout: float = 240) -> dict[str, Any]:
    def found():
        return next((r for r in journal(rd) if r["kind"] == "checkpoint" and r["details"].get("step") == step
                     and not r["details"].get("model_only")), None)
    return wait_for(found, timeout, f"the checkpoint of step {step}")


# ---- final state ----------------------------------------------------------------------------------------------------
def final_slot(rd: Path) -> Path:
    """The newest slot whose manifest verifies (what a resume would pick)."""
    best: Optional[tuple[int, Path]] = None
    for name in SLOTS:
        d = rd / "checkpoints" / name
        m = read_manifest(d)
        if m is not None and verify(d)[0] and (best is None or m["step"] > best[0]):
            best = (int(m["step"]), d)
    assert best is not None, f"{rd}: no verifying checkpoint slot"
    return best[1]


def state_files(slot: Path) -> dict[str, Any]:
    """{relpath: loaded object} of the model and optimizer files of a checkpoint slot."""
    rels = sorted(str(p.relative_to(slot)) for p in slot.rglob("*.pt") if p.parts[-2] in ("model", "optim"))
    return {rel: torch.load(slot / rel, map_location="cpu", weights_only=True) for rel in rels}


def _diff(a: Any, b: Any, where: str) -> Optional[str]:
    """Where two nested (dict / list / tensor / scalar) states first differ, or None when bitwise equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        # bitwise: compare the raw bytes (NaN == NaN, -0.0 != 0.0)
        if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            return f"{where}: values differ (max abs diff {float((a.double() - b.double()).abs().max()):.3e})"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, set(a) ^ set(b)))[:6]} differ"
        for k in a:
            d = _diff(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _diff(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def assert_bitwise_equal(rd: Path, ref: Path) -> None:
    mine, theirs = final_slot(rd), final_slot(ref)
    assert read_manifest(mine)["step"] == read_manifest(theirs)["step"] == STEPS
    a, b = state_files(mine), state_files(theirs)
    assert set(a) == set(b) and any(k.startswith("optim/") for k in a), (sorted(a), sorted(b))
    d = _diff(a, b, "state")
    assert d is None, f"final model/optimizer state differs from the uninterrupted reference: {d}"


# ---- nothing lost ---------------------------------------------------------------------------------------------------
def tree_digest(root: Path) -> dict[str, str]:
    """{relpath: sha256} of every file under root (to prove an earlier run was left untouched)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_nothing_lost(rd: Path, records: list[dict[str, Any]], upto_step: int = STEPS) -> None:
    """Every persistent model checkpoint up to `upto_step` exists and verifies; every attempt kept its log folder;
    the newest full checkpoint verifies."""
    for step in range(MODEL_CKPT_EVERY, upto_step + 1, MODEL_CKPT_EVERY):
        d = rd / "checkpoints" / f"model-step-{step}"
        ok, why = verify(d)
        assert ok, f"persistent checkpoint lost or broken: {why}"
    attempts = sorted({r["details"]["attempt"] for r in launches(records)})
    for a in attempts:
        assert (rd / "logs" / f"attempt{a}").exists(), f"logs of attempt {a} are gone"
    final_slot(rd)


def assert_reference_untouched(ref: Path, digest: dict[str, str]) -> None:
    now = tree_digest(ref)
    lost = sorted(set(digest) - set(now))
    changed = sorted(k for k in digest if k in now and now[k] != digest[k])
    assert not lost and not changed, f"the reference run was disturbed: lost {lost[:5]}, changed {changed[:5]}"


# ---- journal and summary --------------------------------------------------------------------------------------------
def mentions(rec: dict[str, Any], word: str) -> bool:
    return word in json.dumps(rec, default=str)


def assert_story(records: list[dict[str, Any]], node: str, fault_word: str | tuple[str, ...],
                 action_word: str) -> dict[str, Any]:
    """The journal names the fault (a failure/fault record mentioning `fault_word` (or one of them) and `node`) and,
    after it, the action taken (a record mentioning `action_word` and `node`). Returns the fault record."""
    words = (fault_word,) if isinstance(fault_word, str) else fault_word
    fault = next((r for r in records if r["kind"] in ("failure", "fault") and node in r["nodes"]
                  and any(mentions(r, w) for w in words)), None)
    assert fault is not None, f"no failure/fault record names {node} and {fault_word!r}: {kinds(records)}"
    after = [r for r in records if r["time"] >= fault["time"] and r is not fault]
    acted = next((r for r in after if mentions(r, node) and mentions(r, action_word)), None)
    assert acted is not None, f"no record after the fault names {node} and the action {action_word!r}"
    return fault


def assert_summary(summary: dict[str, Any], restarts: int, swapped: Iterable[tuple[str, str]],
                   status: str = "completed", steps_done: int = STEPS) -> None:
    assert summary["status"] == status, summary
    assert summary["steps_done"] == steps_done, summary
    assert summary["restarts"] == restarts, summary
    assert summary["swapped_nodes"] == [{"out": a, "in": b} for a, b in swapped], summary


def kinds(records: list[dict[str, Any]]) -> list[str]:
    return [r["kind"] for r in records]


def resumed_after(records: list[dict[str, Any]], t: float) -> tuple[Optional[dict[str, Any]], dict[str, Any]]:
    """(supervisor's resume record or None, trainer's resume record) of the first attempt started after time t.
    The supervisor journals a resume (with seconds_since_failure) only for relaunches inside one allocation."""
    sup = next((r for r in records if r["kind"] == "resume" and r["time"] >= t
                and "seconds_since_failure" in r["details"]), None)
    tr = next(r for r in records if r["kind"] == "resume" and r["time"] >= t and "checkpoint" in r["details"])
    return sup, tr


def newest_ckpt_before(records: list[dict[str, Any]], t: float) -> int:
    """The newest full checkpoint journaled by time t. Pass the trainer's resume record time: a persist that was
    durable when the allocation ended can be journaled a moment after the failure (the dying trainer's background
    writer records it when the manifest lands), yet it is the one the next attempt must resume from."""
    steps = [r["details"]["step"] for r in records
             if r["kind"] == "checkpoint" and r["time"] <= t and not r["details"].get("model_only")]
    return max(steps)


def report(fault: str, t_fault: float, records: list[dict[str, Any]], note: str = "") -> float:
    """Print (and return) the time from the fault to the resumed training: the first heartbeat of the new attempt
    (supervisor's resume record), else the trainer's checkpoint load (a new allocation)."""
    sup, tr = resumed_after(records, t_fault)
    dt = (sup or tr)["time"] - t_fault
    seen = (f"; supervisor: {sup['details']['seconds_since_failure']:.1f} s from the last heartbeat, "
            f"{sup['details'].get('breakdown')}") if sup else ""
    print(f"\n[fault {fault}] training resumed {dt:.1f} s after the fault (from step {tr['details']['step']}"
          f"{seen}){note}")
    return dt


__all__ = ["finish", "metrics_step", "start", "wait_for"]  # re-exported from e2e_util for the tests


def check_outcome(rd: Path, records: list[dict[str, Any]], summary: dict[str, Any], reference: Any, restarts: int,
                  swapped: Iterable[tuple[str, str]]) -> None:
    """What every surviving fault run must show: summary counts, bitwise-equal final state, nothing lost."""
    assert_summary(summary, restarts, swapped)
    assert_bitwise_equal(rd, reference.run_dir)
    assert_nothing_lost(rd, records)
    assert_reference_untouched(reference.run_dir, reference.digest)
