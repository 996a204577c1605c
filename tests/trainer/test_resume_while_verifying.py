"""The newest slot is loaded while its digests are checked: a damaged slot is still never trained from. Whether the
damage only changes tensor bytes (the load succeeds) or breaks the file (the load raises), the trainer drops what it
loaded and resumes from the older slot; the rejection is journaled at once, and a relaunch skips that slot unread."""

from __future__ import annotations

import shutil

import pytest
import torch
from trainer_harness import launch_ranks, tiny_cfg, write_run

from moe_launch.conf.schema import FaultInjection
from moe_launch.rundir import EXIT_OK, read_jsonl
from moe_launch.trainer.__main__ import build_trainer
from moe_launch.trainer.faults import InjectedCrash
from moe_launch.trainer.loop import Trainer
from moe_launch.trainer.restore import UnverifiedResume

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def two_slots(tmp_path_factory, data_cache):
    """A run that crashed at step 7: ckpt-a holds step 6, ckpt-b step 4."""
    cfg = tiny_cfg(data_cache, fault_injection=FaultInjection(kind="crash", rank=0, step=7, attempt=0))
    rd = write_run(tmp_path_factory.mktemp("crashed"), cfg)
    with pytest.raises(InjectedCrash):
        Trainer(cfg, rd, attempt=0).train()
    return cfg, rd


def _copy(two_slots, dest):
    cfg, rd = two_slots
    out = write_run(dest, cfg)
    shutil.copytree(rd.checkpoints, out.checkpoints, dirs_exist_ok=True)
    return cfg, out


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55  # inside the tensor bytes: torch.load still succeeds
    path.write_bytes(bytes(data))


def _rejections(rd):
    return [e["details"] for e in read_jsonl(rd.journal) if "checkpoint_rejected" in e["details"]]


def _resumes(rd):
    return [e["details"] for e in read_jsonl(rd.journal) if e["kind"] == "resume"]


def test_damaged_tensor_bytes_are_dropped_after_loading(two_slots, tmp_path):
    cfg, rd = _copy(two_slots, tmp_path / "run")
    _flip_middle_byte(next((rd.checkpoints / "ckpt-a" / "model").glob("*.pt")))
    with pytest.raises(UnverifiedResume, match="mismatch"):
        Trainer(cfg, rd, attempt=1)
    assert [(r["checkpoint_rejected"], r["manifest_step"]) for r in _rejections(rd)] == [("ckpt-a", 6)]
    assert _resumes(rd) == []  # nothing was resumed from the damaged slot

    trainer = build_trainer(cfg, rd, 2, torch.device("cpu"))
    assert trainer.start_step == 4
    [resume] = _resumes(rd)
    assert resume["slot"] == "ckpt-b" and resume["fell_back"] is True
    assert "rejected by attempt 1" in resume["rejected"]["ckpt-a"]  # skipped unread: the journal named it
    assert trainer.train() == EXIT_OK


def test_a_file_the_load_cannot_parse_falls_back_too(two_slots, tmp_path):
    cfg, rd = _copy(two_slots, tmp_path / "run")
    model_file = next((rd.checkpoints / "ckpt-a" / "model").glob("*.pt"))
    model_file.write_bytes(model_file.read_bytes()[:-200])  # the zip's directory is gone: torch.load raises
    trainer = build_trainer(cfg, rd, 1, torch.device("cpu"))
    assert trainer.start_step == 4
    assert [r["checkpoint_rejected"] for r in _rejections(rd)] == ["ckpt-a"]


def test_an_intact_slot_resumes_without_a_rejection(two_slots, tmp_path):
    cfg, rd = _copy(two_slots, tmp_path / "run")
    trainer = build_trainer(cfg, rd, 1, torch.device("cpu"))
    assert trainer.start_step == 6 and _rejections(rd) == []
    [resume] = _resumes(rd)
    assert resume["slot"] == "ckpt-a" and resume["fell_back"] is False


def test_every_rank_drops_the_damaged_slot(tmp_path, data_cache):
    """dp=2 on gloo: rank 0 checks, both ranks loaded; the verdict reaches both and both rebuild from ckpt-b."""
    cfg = tiny_cfg(data_cache, dp=2, fault_injection=FaultInjection(kind="crash", rank=0, step=7, attempt=0))
    rd = write_run(tmp_path / "run", cfg)
    launch_ranks(rd, world=2, attempt=0)
    assert _resumes(rd) == []
    _flip_middle_byte(next((rd.checkpoints / "ckpt-a" / "model").glob("*.pt")))
    procs = launch_ranks(rd, world=2, attempt=1)
    assert all(p.returncode == EXIT_OK for p in procs), [p.stdout[-2000:] for p in procs]
    [resume] = _resumes(rd)
    assert resume["slot"] == "ckpt-b" and resume["step"] == 4 and resume["fell_back"] is True
    assert [r["checkpoint_rejected"] for r in _rejections(rd)] == ["ckpt-a"]
