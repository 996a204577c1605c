"""train.ckpt_when_busy: a full checkpoint due while the previous one is still being written waits (every checkpoint
taken, training blocked) or is skipped (training goes on, the journal names the skipped step). The disk is made
slow by delaying each file write of the real writer."""

import time

import pytest
import torch
from trainer_harness import tiny_cfg, write_run

from moe_launch.rundir import EXIT_OK, read_jsonl
from moe_launch.trainer.checkpoint import store
from moe_launch.trainer.loop import Trainer

torch.set_num_threads(1)
WRITE_DELAY_S = 0.4


@pytest.fixture
def slow_disk(monkeypatch):
    real = store.write_file

    def slow_write(*args, **kwargs):
        time.sleep(WRITE_DELAY_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "write_file", slow_write)


def _checkpoints(rd) -> tuple[list[int], list[int]]:
    journal = read_jsonl(rd.journal)
    taken = [e["details"]["step"] for e in journal if e["kind"] == "checkpoint" and "slot" in e["details"]
             and not e["details"].get("model_only")]
    skipped = [e["details"]["skipped_checkpoint"] for e in journal if "skipped_checkpoint" in e["details"]]
    return taken, skipped


@pytest.mark.parametrize("policy", ["wait", "skip"])
def test_a_checkpoint_due_while_the_previous_persists(policy, slow_disk, tmp_path, data_cache):
    cfg = tiny_cfg(data_cache, steps=6, ckpt_interval=1, ckpt_when_busy=policy)
    rd = write_run(tmp_path / policy, cfg)
    assert Trainer(cfg, rd).train() == EXIT_OK
    taken, skipped = _checkpoints(rd)
    if policy == "wait":
        assert taken == [1, 2, 3, 4, 5, 6] and skipped == []
        return
    # every persist outlasts a step, so each one after the first falls due while the previous is still running;
    # the last step's checkpoint is taken at the end even when skipped inside the loop
    assert skipped and taken[-1] == 6
    assert sorted(set(taken + skipped)) == [1, 2, 3, 4, 5, 6] and len(taken) < 6
