"""Faults 11, 12, 13 around the allocation: the login-side moe-launch killed (attach follows again; the run never
stopped), a preemption / time-limit signal (checkpoint, resubmit, resume), and more failures than buffers (clean stop,
then a later moe-launch with more nodes resumes the same run from its checkpoints)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from e2e_util import MOE_LAUNCH
from harness import (
    RUN_TIMEOUT_S,
    SLOW,
    STEPS,
    assert_bitwise_equal,
    assert_nothing_lost,
    assert_reference_untouched,
    check_outcome,
    final_slot,
    finish,
    journal,
    launches,
    newest_ckpt_before,
    overrides,
    report,
    resumed_after,
    start,
    wait_launch,
    wait_step,
)

from moe_launch.rundir import read_jsonl
from moe_launch.trainer.checkpoint.store import read_manifest

pytestmark = pytest.mark.slurm


def _attach(tmp_path, rd, name: str) -> tuple[int, dict, list]:
    log = open(tmp_path / f"{name}.out", "wb")
    proc = subprocess.Popen([MOE_LAUNCH, "attach", str(rd)], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        print((tmp_path / f"{name}.out").read_text()[-3000:])
    return code, json.loads((rd / "summary.json").read_text()), read_jsonl(rd / "journal.jsonl")


def test_fault11_login_side_killed_attach_follows(reference, tmp_path):
    proc, rd = start(tmp_path, "f11", *overrides(1, SLOW))
    wait_launch(rd)
    wait_step(rd, 4)
    proc.kill()  # SIGKILL: the login session is gone without a word
    proc.wait()
    t_fault = time.time()
    code, summary, records = _attach(tmp_path, rd, "f11-attach")
    assert code == 0, summary
    assert [r["kind"] for r in records].count("allocation") == 1 and "resubmit" not in [r["kind"] for r in records]
    assert len(launches(records)) == 1  # the run never stopped: one allocation, one attempt
    attach = next(r for r in records if r["kind"] == "attach")
    assert attach["time"] >= t_fault
    check_outcome(rd, records, summary, reference, restarts=0, swapped=[])
    print(f"\n[fault 11 login side killed] attach re-followed {attach['time'] - t_fault:.1f} s after the kill; "
          f"training never stopped (one attempt)")


def test_fault12_preemption_signal_checkpoints_and_resubmits(reference, tmp_path):
    """`scancel --signal=USR2` (what --signal=USR2@N delivers before the time limit, and what preemption sends) reaches
    the trainer ranks; they checkpoint and exit 4, the allocation ends, the login side resubmits and the run resumes
    from that checkpoint."""
    proc, rd = start(tmp_path, "f12", *overrides(1, SLOW))
    wait_launch(rd)
    job = next(r for r in journal(rd) if r["kind"] == "start")["details"]["handle"]
    wait_step(rd, 4)
    t_fault = time.time()
    subprocess.run(["scancel", "--signal=USR2", str(job)], check=True, timeout=30)
    code, summary, records = finish(proc, tmp_path, "f12", RUN_TIMEOUT_S)
    assert code == 0, summary
    stop = next(r for r in records if r["kind"] == "stop" and r["details"].get("reason") == "signal")
    signal_ckpt = stop["details"]["step"]
    assert any(r["kind"] == "checkpoint" and r["details"]["step"] == signal_ckpt for r in records)
    preempted = next(r for r in records if r["kind"] == "stop" and r["time"] >= stop["time"]
                     and r["details"].get("action", {}).get("status") == "preempted")
    assert "preemption" in preempted["details"]["reason"]
    resub = next(r for r in records if r["kind"] == "resubmit")
    assert summary["resubmits"] == 1
    _, trainer = resumed_after(records, resub["time"])
    assert trainer["details"]["step"] == signal_ckpt == newest_ckpt_before(records, trainer["time"])
    check_outcome(rd, records, summary, reference, restarts=0, swapped=[])
    report("12 preemption signal", t_fault, records, f" (checkpoint of step {signal_ckpt} on the signal)")


def test_fault13_buffers_exhausted_stop_then_resume_with_more_nodes(reference, tmp_path):
    inject = ["train.fault_injection.kind=nan", "train.fault_injection.rank=1", "train.fault_injection.step=5"]
    proc, rd = start(tmp_path, "f13", *overrides(0, *inject))
    code, summary, records = finish(proc, tmp_path, "f13", RUN_TIMEOUT_S)
    assert code != 0 and summary["status"] == "failed", summary
    assert "buffers exhausted" in summary["reason"] and "cluster.buffers" in summary["reason"], summary["reason"]
    fault = next(r for r in records if r["kind"] == "fault" and r["details"].get("event") == "Fault")
    stop = next(r for r in records if r["kind"] == "stop" and r["time"] >= fault["time"])
    assert fault["nodes"][0] in stop["details"]["reason"]
    assert summary["restarts"] == 0 and summary["swapped_nodes"] == []
    # nothing lost: the newest checkpoint that verifies on disk holds step 3, the last before the fault (its journal
    # record can land after the fault's: the persist of step 3 may still be in flight when step 5 faults)
    assert read_manifest(final_slot(rd))["step"] == 3
    kept = {p.relative_to(rd): p.read_bytes() for p in (rd / "logs").rglob("*") if p.is_file()}

    # later: the same run, started again with one buffer node more, resumes from step 3 and finishes
    t_again = time.time()
    proc, rd2 = start(tmp_path, "f13", *overrides(1, *inject))
    assert rd2 == rd
    code, summary2, records2 = finish(proc, tmp_path, "f13", RUN_TIMEOUT_S)
    assert code == 0, summary2
    assert (rd / "summary-0.json").exists()  # the first outcome is kept
    _, trainer = resumed_after(records2, t_again)
    assert trainer["details"]["step"] == 3
    assert summary2["status"] == "completed" and summary2["steps_done"] == STEPS
    lost = [str(rel) for rel, data in kept.items() if not (rd / rel).is_file() or (rd / rel).read_bytes() != data]
    assert not lost, f"logs of the first start lost or changed: {lost}"
    assert_bitwise_equal(rd, reference.run_dir)
    assert_nothing_lost(rd, records2)
    assert_reference_untouched(reference.run_dir, reference.digest)
    print(f"\n[fault 13 buffers exhausted] stopped cleanly ({summary['reason'][:70]}...); the later start resumed "
          f"from step 3 {trainer['time'] - t_again:.1f} s after it was submitted")
