"""The run-directory outputs of a short run: metrics.jsonl fields, heartbeats, TensorBoard events, checkpoints."""

import json
import os

import torch
from trainer_harness import tiny_cfg, write_run

from moe_launch.rundir import EXIT_OK, read_jsonl
from moe_launch.trainer.loop import Trainer

torch.set_num_threads(1)

CONTRACT = {"step", "loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "lr", "tokens_per_s", "expert_load_max",
            "expert_load_mean", "time"}


def test_metrics_heartbeat_tensorboard_and_journal(tmp_path, data_cache):
    cfg = tiny_cfg(data_cache, steps=3, ckpt_interval=2, tracking=["tensorboard"], progress=True)
    rd = write_run(tmp_path / "run", cfg)
    assert Trainer(cfg, rd).train() == EXIT_OK
    metrics = read_jsonl(rd.metrics)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert CONTRACT <= m.keys()
        assert abs(m["loss"] - (m["lm_loss"] + m["aux_loss"] + m["z_loss"])) < 1e-5
        assert len(m["aux_per_layer"]) == 2 and m["expert_load_max"] >= m["expert_load_mean"] >= 1.0
        assert m["tokens_per_s"] > 0 and m["grad_norm"] > 0
    assert metrics[0]["lr"] == cfg.train.lr / 2  # warm-up of 2 steps
    beat = json.loads((rd.heartbeat / "rank0.json").read_text())
    assert beat["step"] == 3 and beat["pid"] == os.getpid() and beat["host"]
    assert any(p.name.startswith("events.out.tfevents") for p in (rd.root / "tensorboard").iterdir())
    # checkpoints at step 2 (interval) and 3 (the end of the run), in alternating slots
    ckpts = [(e["details"]["slot"], e["details"]["step"]) for e in read_jsonl(rd.journal) if e["kind"] == "checkpoint"]
    assert ckpts == [("ckpt-a", 2), ("ckpt-b", 3)]


def test_dense_model_trains_and_reports_no_expert_load(tmp_path, data_cache):
    cfg = tiny_cfg(data_cache, steps=2, ckpt_interval=0)
    cfg.model.kind = "dense"
    cfg.model.ffn_hidden = 64
    rd = write_run(tmp_path / "run", cfg)
    assert Trainer(cfg, rd).train() == EXIT_OK
    m = read_jsonl(rd.metrics)[-1]
    assert m["expert_load_max"] is None and m["aux_loss"] == 0.0 and m["z_loss"] == 0.0
