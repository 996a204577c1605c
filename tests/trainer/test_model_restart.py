"""model.init_from=ckpt:<model-step-N> continues at step N with a fresh optimizer: the learning rate and the batch of
step N+1 are the original run's (so is its loss, computed with the checkpoint's weights before any update), the
checkpoint records that position and schedule, and train.rewarmup_steps ramps the fresh optimizer's rate back up."""

from __future__ import annotations

import pytest
import torch
from trainer_harness import tiny_cfg, write_run

from moe_launch.rundir import EXIT_OK, read_jsonl
from moe_launch.trainer.checkpoint.store import read_manifest
from moe_launch.trainer.optim import rewarmup_factor

torch.set_num_threads(1)


def _records(rd) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(rd.metrics)}


def test_rewarmup_factor_ramps_after_the_restart_step_only():
    assert [rewarmup_factor(s, 10, 4) for s in (10, 11, 12, 13, 14)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert rewarmup_factor(3, None, 4) == 1.0 and rewarmup_factor(10, 10, 0) == 1.0


@pytest.mark.parametrize("rewarmup", [0, 2])
def test_restart_from_model_step_n_continues_with_the_original_lr_and_batch(tmp_path, data_cache, rewarmup):
    from moe_launch.trainer.loop import Trainer

    # warm-up longer than N: the restarted run must be inside the original's warm-up, not at its start
    common = dict(steps=8, ckpt_interval=0, warmup_steps=6)
    cfg = tiny_cfg(data_cache, model_ckpt_interval=4, **common)
    orig = write_run(tmp_path / "orig", cfg)
    assert Trainer(cfg, orig).train() == EXIT_OK
    want = _records(orig)
    meta = read_manifest(orig.checkpoints / "model-step-4")["meta"]
    assert meta["step"] == 4 and meta["data"]["position"] == 4 * cfg.train.global_batch_size
    assert meta["schedule"]["next_lr"] == want[5]["lr"] and meta["data_skips"] == []

    again = tiny_cfg(data_cache, rewarmup_steps=rewarmup, **common)
    again.model.init_from = f"ckpt:{orig.checkpoints / 'model-step-4'}"
    rd = write_run(tmp_path / "again", again)
    trainer = Trainer(again, rd)
    assert trainer.start_step == 4 and trainer.optimizer.step_count == 0
    assert trainer.train() == EXIT_OK
    got = _records(rd)
    assert sorted(got) == [5, 6, 7, 8]
    assert got[5]["loss"] == want[5]["loss"]  # same weights, same batch: bitwise in deterministic mode
    if rewarmup == 0:
        assert [got[s]["lr"] for s in (5, 6, 7, 8)] == [want[s]["lr"] for s in (5, 6, 7, 8)]
    else:
        assert got[5]["lr"] == pytest.approx(want[5]["lr"] / 2) and got[6]["lr"] == want[6]["lr"]
