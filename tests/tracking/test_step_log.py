"""The step log line and the step record's derived fields (MFU, expert counts, memory) from a real in-process run."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_harness import tiny_cfg, write_run  # noqa: E402

from moe_launch.rundir import EXIT_OK, read_jsonl  # noqa: E402
from moe_launch.trainer.loop import Trainer  # noqa: E402
from moe_launch.trainer.metrics import PerfRefs  # noqa: E402
from moe_launch.trainer.tracking.flops import flops_per_token  # noqa: E402
from moe_launch.trainer.tracking.steplog import format_step_line, install_rank_logging  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data-cache"))


def test_format_step_line_names_every_field_it_has():
    record = {"step": 20, "loss": 5.4321, "lm_loss": 5.41, "aux_loss": 0.0201, "z_loss": 0.0018, "lr": 3e-3,
              "grad_norm": 1.25, "tokens_per_s": 12345.6, "mfu": 0.451, "mfu_gemm": 0.602, "expert_load_max": 1.32,
              "expert_load_mean": 1.12, "mem_gib": 12.34, "step_time_s": 0.25}
    line = format_step_line(record, 60)
    assert line == ("step 20/60 | loss 5.4321 (lm 5.4100 aux 0.0201 z 0.0018) | lr 3.00e-03 | grad norm 1.250 | "
                    "12,346 tok/s | mfu 45.1% / 60.2% of measured GEMM | expert load max 1.32 mean 1.12 | "
                    "mem 12.3 GiB | 0.250 s/step")
    dense_cpu = {"step": 3, "loss": 2.0, "lm_loss": 2.0, "aux_loss": 0.0, "z_loss": 0.0, "mfu": None,
                 "mfu_gemm": None, "expert_load_max": None, "expert_load_mean": None}
    assert format_step_line(dense_cpu, 9) == "step 3/9 | loss 2.0000 (lm 2.0000 aux 0.0000 z 0.0000)"


def test_perf_refs_mfu_against_both_references():
    refs = PerfRefs(flops_per_token=1e9, devices=4, spec_peak=1e12, gemm_rate=None)
    assert refs.mfu(2000.0) == (pytest.approx(0.5), None)
    assert PerfRefs(1e9, 2, None, 4e12).mfu(4000.0) == (None, pytest.approx(0.5))


def test_rank_prefix_and_no_duplicate_handlers(capsys):
    install_rank_logging(3, "nodeA")
    logger = install_rank_logging(0, "nodeB")
    logger.info("hello")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].endswith("[nodeB r0] hello")
    assert logging.getLogger("moe_launch.trainer").getEffectiveLevel() == logging.INFO


def test_record_has_mfu_counts_and_memory_and_log_lines(tmp_path, data_cache, capsys):
    cfg = tiny_cfg(data_cache, steps=4, ckpt_interval=0, log_interval=2, peak_flops=1e12, tracking=[])
    rd = write_run(tmp_path / "run", cfg)
    # what the preflight wrote for this node: its measured GEMM rate is the second MFU reference
    from moe_launch.rundir import node_name

    (rd.health / "preflight.json").write_text(json.dumps({"results": [
        {"node": node_name(), "check": "compute", "status": "pass", "value": 0.5}]}))
    assert Trainer(cfg, rd).train() == EXIT_OK
    metrics = read_jsonl(rd.metrics)
    assert [m["step"] for m in metrics] == [2, 4]  # log_interval
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    for m in metrics:
        assert m["mfu"] == pytest.approx(m["tokens_per_s"] * fpt / 1e12)
        assert m["mfu_gemm"] == pytest.approx(m["tokens_per_s"] * fpt / 0.5e12)
        counts_LE = m["expert_counts"]
        assert len(counts_LE) == cfg.model.n_layers and len(counts_LE[0]) == cfg.model.moe.num_experts
        pairs = cfg.train.global_batch_size * cfg.train.seq_len * cfg.model.moe.top_k
        assert all(sum(row) == pairs for row in counts_LE)
        assert m["mem_gib"] > 0 and m["step_time_s"] > 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "| loss" in ln]
    assert [ln.split("] ")[1].split(" |")[0] for ln in lines] == ["step 2/4", "step 4/4"]
    assert all(f"[{node_name()} r0]" in ln and "mfu " in ln and "expert load max" in ln for ln in lines)


def test_no_progress_bar_without_a_terminal(tmp_path, monkeypatch):
    """Under srun or `| tee` stdout is a file or pipe: the bar would be one stale line in the log."""
    import io

    from moe_launch.rundir import RunDir
    from moe_launch.trainer.metrics import MetricsSink

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    sink = MetricsSink(RunDir(tmp_path).make(), total_steps=5, start_step=0, tracking=[], progress=True)
    assert sink.progress is None
    sink.close()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed (pip install wandb)")
def test_train_tracking_wandb_offline_through_the_trainer(tmp_path, data_cache, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_cfg(data_cache, steps=2, ckpt_interval=0, tracking=["tensorboard", "wandb"])
    rd = write_run(tmp_path / "run", cfg)
    assert Trainer(cfg, rd).train() == EXIT_OK
    (run,) = (rd.root / "wandb").glob("offline-run-*")
    assert b"train/loss" in next(run.glob("*.wandb")).read_bytes()
    assert any(p.name.startswith("events.out.tfevents") for p in (rd.root / "tensorboard").iterdir())
