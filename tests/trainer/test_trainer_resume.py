"""Deterministic resume: an interrupted run resumed from either checkpoint continues bitwise like an uninterrupted
one; a damaged newest checkpoint is detected, the older one is used and the journal says so."""

import shutil

import pytest
import torch
from trainer_harness import tiny_cfg, write_run

from moe_launch.conf.schema import FaultInjection
from moe_launch.rundir import EXIT_OK, read_jsonl
from moe_launch.trainer.__main__ import build_trainer
from moe_launch.trainer.checkpoint.store import MANIFEST, choose_resume_slot
from moe_launch.trainer.faults import InjectedCrash
from moe_launch.trainer.loop import Trainer
from moe_launch.trainer.restore import UnverifiedResume

torch.set_num_threads(1)


def _losses(rd, after: int = 0) -> dict[int, float]:
    out = {}
    for rec in read_jsonl(rd.metrics):
        if rec["step"] > after:
            out[rec["step"]] = rec["loss"]  # later lines (the resumed attempt) win
    return out


def test_resume_from_either_checkpoint_is_bitwise_equal(tmp_path, data_cache):
    ref = write_run(tmp_path / "ref", tiny_cfg(data_cache))
    assert Trainer(tiny_cfg(data_cache), ref).train() == EXIT_OK
    ref_losses = _losses(ref)
    assert sorted(ref_losses) == list(range(1, 9))

    crash = tiny_cfg(data_cache, fault_injection=FaultInjection(kind="crash", rank=0, step=7, attempt=0))
    run = write_run(tmp_path / "run", crash)
    with pytest.raises(InjectedCrash):
        Trainer(crash, run, attempt=0).train()
    choice = choose_resume_slot(run.checkpoints)
    assert (choice.path.name, choice.step) == ("ckpt-a", 6)  # 2 -> a, 4 -> b, 6 -> a
    damaged = write_run(tmp_path / "damaged", crash)
    shutil.copytree(run.checkpoints, damaged.checkpoints, dirs_exist_ok=True)

    # newest checkpoint (step 6): the injected crash is for attempt 0 only, so attempt 1 runs through
    trainer = Trainer(crash, run, attempt=1)
    assert trainer.start_step == 6
    assert trainer.train() == EXIT_OK
    assert {s: v for s, v in _losses(run, 6).items()} == {s: ref_losses[s] for s in (7, 8)}

    # older checkpoint (step 4): corrupt the newest's model file; resume must fall back and say so. The slot is
    # loaded while its digests are checked: the Trainer itself refuses what it loaded, build_trainer falls back
    model_file = damaged.checkpoints / "ckpt-a" / "model" / "dense.pt"
    data = bytearray(model_file.read_bytes())
    data[-100] ^= 0x55
    model_file.write_bytes(bytes(data))
    with pytest.raises(UnverifiedResume, match="mismatch"):
        Trainer(crash, damaged, attempt=1)
    trainer = build_trainer(crash, damaged, 1, torch.device("cpu"))
    assert trainer.start_step == 4
    assert trainer.train() == EXIT_OK
    assert _losses(damaged, 4) == {s: ref_losses[s] for s in (5, 6, 7, 8)}
    resume = [e for e in read_jsonl(damaged.journal) if e["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["details"]["fell_back"] is True
    assert resume[0]["details"]["slot"] == "ckpt-b" and "mismatch" in resume[0]["details"]["rejected"]["ckpt-a"]
    # the new checkpoint of step 6 went into the damaged slot, never over the one that was just used
    assert [(e["details"]["slot"], e["details"]["step"]) for e in read_jsonl(damaged.journal)
            if e["kind"] == "checkpoint"] == [("ckpt-a", 6), ("ckpt-b", 8)]


def test_model_only_checkpoint_restarts_with_fresh_optimizer(tmp_path, data_cache):
    cfg = tiny_cfg(data_cache, steps=4, ckpt_interval=0, model_ckpt_interval=4)
    rd = write_run(tmp_path / "a", cfg)
    src = Trainer(cfg, rd)
    assert src.train() == EXIT_OK
    model_dir = rd.checkpoints / "model-step-4"
    assert (model_dir / MANIFEST).exists() and sorted(p.name for p in (model_dir / "model").iterdir()) == \
        ["dense.pt", "experts-ep0.pt"]
    assert not (rd.checkpoints / "ckpt-a").exists()

    cfg2 = tiny_cfg(data_cache, steps=4, ckpt_interval=0)
    cfg2.model.init_from = f"ckpt:{model_dir}"
    rd2 = write_run(tmp_path / "b", cfg2)
    t2 = Trainer(cfg2, rd2)
    assert t2.start_step == 4 and t2.optimizer.step_count == 0  # continues at the checkpoint's step
    for (name, a), (_, b) in zip(src.model.named_parameters(), t2.model.named_parameters()):
        assert torch.equal(a, b), name
    event = [e for e in read_jsonl(rd2.journal) if e["kind"] == "resume"][0]["details"]
    assert event["model_only"] and event["fresh_optimizer"]
