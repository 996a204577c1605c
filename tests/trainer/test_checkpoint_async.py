"""Asynchronous checkpoints: the snapshot is the state at the request (training goes on meanwhile), host buffers are
allocated once, a kill during the background persist and a full disk both leave the older slot valid, and a trainer
whose checkpoints keep failing stops with EXIT_CHECKPOINT_WRITE."""

from __future__ import annotations

import subprocess

import pytest
import torch
from trainer_harness import launch_ranks, tiny_cfg, write_run

from moe_launch.conf.schema import FaultInjection
from moe_launch.rundir import EXIT_CHECKPOINT_WRITE, EXIT_OK, EXIT_PREEMPTED, read_jsonl
from moe_launch.trainer.checkpoint.manager import persist_failure_reason
from moe_launch.trainer.checkpoint.persist import AsyncCheckpointer, PersistResult, Target
from moe_launch.trainer.checkpoint.store import MANIFEST, choose_resume_slot, load_file, room_needed, verify
from moe_launch.trainer.dist import Comm
from moe_launch.trainer.loop import Trainer

torch.set_num_threads(1)


def _target(path, rels):
    return Target(path, {rel: (lambda host, rel=rel: host[rel]) for rel in rels})


def test_persisted_checkpoint_holds_the_state_at_the_request(tmp_path):
    w_N = torch.arange(1000, dtype=torch.float32)
    results: list[PersistResult] = []
    writer = AsyncCheckpointer(torch.device("cpu"), Comm(), results.append)
    stall_s, previous = writer.request(3, [_target(tmp_path / "ckpt-a", ["model/dense.pt"])],
                                       {"model/dense.pt": {"w": w_N}})
    w_N.add_(1.0)  # the next optimizer step, while the write may still be going on
    result = writer.wait()
    assert previous is None and result is results[0] and result.ok and result.done == [str(tmp_path / "ckpt-a")]
    assert 0 <= result.stall_s <= result.durable_s and result.bytes > 4000
    assert verify(tmp_path / "ckpt-a") == (True, "ok")
    assert torch.equal(load_file(tmp_path / "ckpt-a", "model/dense.pt")["w"], torch.arange(1000, dtype=torch.float32))


def test_host_buffers_are_allocated_once(tmp_path):
    state = {"model/dense.pt": {"w": torch.zeros(256), "b": torch.ones(3, dtype=torch.bfloat16)}}
    writer = AsyncCheckpointer(torch.device("cpu"), Comm(), lambda r: None)
    ptrs = []
    for step, slot in ((1, "ckpt-a"), (2, "ckpt-b"), (3, "ckpt-a")):
        writer.request(step, [_target(tmp_path / slot, ["model/dense.pt"])], state)
        ptrs.append(sorted(t.data_ptr() for t in writer.snapshot.tree["model/dense.pt"].values()))
    assert writer.wait().ok and ptrs[0] == ptrs[1] == ptrs[2]
    assert writer.snapshot.nbytes == 256 * 4 + 3 * 2


def test_stop_only_after_repeated_failures():
    failed = PersistResult(step=4, dirs=["x"], ok=False, stall_s=0, durable_s=0, bytes=0, error="No space left on "
                           "device", error_path="/ckpt/.ckpt-b.tmp/optim/ep0.pt")
    assert persist_failure_reason([]) is None and persist_failure_reason([], final=True) is None
    assert persist_failure_reason([failed]) is None
    assert "optim/ep0.pt: No space left" in persist_failure_reason([failed], final=True)
    assert "2 checkpoints in a row" in persist_failure_reason([failed, failed])


def _checkpoint_tmpfs(tmp_path, size: str):
    """A run's checkpoint directory on a tmpfs of `size` (the tiny model's checkpoint takes 1.1 MB)."""
    disk = tmp_path / "run" / "checkpoints"
    disk.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """Room for one checkpoint but not two."""
    yield from _checkpoint_tmpfs(tmp_path, "1600k")


def test_full_disk_keeps_the_older_slot_and_stops_the_trainer(small_disk, data_cache):
    cfg = tiny_cfg(data_cache)  # checkpoints at steps 2, 4, 6, 8
    rd = write_run(small_disk.parent, cfg)
    assert Trainer(cfg, rd).train() == EXIT_CHECKPOINT_WRITE
    journal = read_jsonl(rd.journal)
    written = [(r["details"]["slot"], r["details"]["step"]) for r in journal
               if r["kind"] == "checkpoint" and not r["details"].get("failed")]
    assert written == [("ckpt-a", 2)]
    failed = [r["details"] for r in journal if r["details"].get("failed")]
    assert [f["step"] for f in failed] == [4, 6]  # step 6 retried the same (non-newest) slot
    assert all(".ckpt-b.tmp" in f["path"] and "No space left on device" in f["error"] for f in failed)
    stop = next(r["details"] for r in journal if r["kind"] == "stop")
    assert stop["reason"] == "checkpoint_write" and stop["step"] == 8 and stop["checkpoint"] == "ckpt-a"
    choice = choose_resume_slot(rd.checkpoints)
    assert (choice.path.name, choice.step, choice.fell_back) == ("ckpt-a", 2, False)
    assert not (rd.checkpoints / ".ckpt-b.tmp").exists() and not (rd.checkpoints / "ckpt-b").exists()


def test_kill_during_the_background_persist_resumes_from_the_older_slot(tmp_path, data_cache):
    ref = write_run(tmp_path / "ref", tiny_cfg(data_cache))
    assert Trainer(tiny_cfg(data_cache), ref).train() == EXIT_OK
    cfg = tiny_cfg(data_cache, fault_injection=FaultInjection(kind="kill_during_ckpt", rank=0, step=4, attempt=0))
    rd = write_run(tmp_path / "run", cfg)
    (proc,) = launch_ranks(rd, world=1)
    assert proc.returncode == -9, proc.stdout[-3000:]
    assert (rd.checkpoints / ".ckpt-b.tmp" / "trainer.pt").exists()  # its shards were on disk
    assert not (rd.checkpoints / ".ckpt-b.tmp" / MANIFEST).exists() and not (rd.checkpoints / "ckpt-b").exists()
    choice = choose_resume_slot(rd.checkpoints)
    assert (choice.path.name, choice.step) == ("ckpt-a", 2)
    (proc,) = launch_ranks(rd, world=1, attempt=1)
    assert proc.returncode == EXIT_OK, proc.stdout[-3000:]
    final = choose_resume_slot(rd.checkpoints).path
    ref_final = choose_resume_slot(ref.checkpoints).path
    for rel in ("model/dense.pt", "model/experts-ep0.pt", "optim/ep0.pt"):
        _assert_bitwise(load_file(final, rel), load_file(ref_final, rel))


def _assert_bitwise(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_bitwise(a[k], b[k])
    else:
        assert a == b


def test_reserved_buffers_are_the_ones_the_capture_fills(tmp_path):
    state = {"model/dense.pt": {"w": torch.randn(300)}, "trainer.pt": {"step": 1}}
    writer = AsyncCheckpointer(torch.device("cpu"), Comm(), lambda r: None)
    writer.snapshot.reserve(state)
    writer.snapshot._reserving.join()
    reserved = writer.snapshot.nbytes
    writer.request(1, [_target(tmp_path / "ckpt-a", list(state))], state)
    assert writer.wait().ok and reserved == writer.snapshot.nbytes == 300 * 4
    assert torch.equal(load_file(tmp_path / "ckpt-a", "model/dense.pt")["w"], state["model/dense.pt"]["w"])


def test_preemption_exits_only_once_its_checkpoint_is_durable(tmp_path, data_cache):
    cfg = tiny_cfg(data_cache, ckpt_interval=0)  # no interval checkpoints: the preemption's is the only one
    rd = write_run(tmp_path / "run", cfg)
    trainer = Trainer(cfg, rd)
    trainer.stop_requested = True  # what SIGUSR2 / SIGTERM set
    assert trainer.train() == EXIT_PREEMPTED
    assert not trainer.ckpt.writer.in_flight  # the background persist was waited for, not left running
    choice = choose_resume_slot(rd.checkpoints)
    assert (choice.path.name, choice.step) == ("ckpt-a", 1)
    stop = next(r["details"] for r in read_jsonl(rd.journal) if r["kind"] == "stop")
    written = next(r for r in read_jsonl(rd.journal) if r["kind"] == "checkpoint")
    assert stop["checkpoint"] == "ckpt-a" and written["details"]["step"] == 1 and written["time"] <= \
        next(r["time"] for r in read_jsonl(rd.journal) if r["kind"] == "stop")


@pytest.fixture
def two_checkpoint_disk(tmp_path):
    """Room for two checkpoints but not three."""
    yield from _checkpoint_tmpfs(tmp_path, "2800k")


def test_a_disk_with_room_for_two_checkpoints_replaces_the_older_slot_first(two_checkpoint_disk, data_cache):
    cfg = tiny_cfg(data_cache)  # checkpoints at steps 2 (a), 4 (b), 6 (a), 8 (b)
    rd = write_run(two_checkpoint_disk.parent, cfg)
    assert Trainer(cfg, rd).train() == EXIT_OK
    journal = read_jsonl(rd.journal)
    written = [(r["details"]["slot"], r["details"]["step"]) for r in journal
               if r["kind"] == "checkpoint" and not r["details"].get("failed")]
    assert written == [("ckpt-a", 2), ("ckpt-b", 4), ("ckpt-a", 6), ("ckpt-b", 8)]
    choice = choose_resume_slot(rd.checkpoints)
    assert (choice.path.name, choice.step, choice.fell_back) == ("ckpt-b", 8, False)
    assert verify(rd.checkpoints / "ckpt-a")[0]


def test_room_needed_only_when_the_replacement_would_not_fit():
    assert room_needed(free_bytes=100 << 20, replaced_bytes=60 << 20)
    assert not room_needed(free_bytes=1 << 30, replaced_bytes=60 << 20)


def test_a_slot_is_valid_only_once_the_model_checkpoint_of_its_step_is(tmp_path, data_cache):
    """A relaunch resumes from the newest valid slot and never redoes its step. So when a full and a model-only
    checkpoint fall on the same step, the model-only one is written first: a process lost between the two commits
    must not leave a resumable slot at step s without model-step-s (that checkpoint would never be written)."""
    cfg = tiny_cfg(data_cache, ckpt_interval=2, model_ckpt_interval=4)  # both at steps 4 and 8
    rd = write_run(tmp_path / "run", cfg)
    assert Trainer(cfg, rd).train() == EXIT_OK
    order = [r["details"]["slot"] for r in read_jsonl(rd.journal) if r["kind"] == "checkpoint"]
    assert order == ["ckpt-a", "model-step-4", "ckpt-b", "ckpt-a", "model-step-8", "ckpt-b"], order
    for step in (4, 8):
        assert verify(rd.checkpoints / f"model-step-{step}") == (True, "ok")
