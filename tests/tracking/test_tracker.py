"""Tracker -> real TensorBoard event files (read back with TensorBoard's own reader) and a W&B offline run."""

from __future__ import annotations

import math

import pytest

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.errors import ConfigError
from moe_launch.trainer.tracking import Tracker
from moe_launch.trainer.tracking.flops import (
    active_matmul_params,
    flops_per_token,
    fp8_flops_per_token,
    measured_gemm_rate,
    mfu,
    spec_peak,
    step_peak,
)
from moe_launch.trainer.tracking.scalars import layer_load, to_scalars
from moe_launch.trainer.tracking.tracker import check_backends, installed


def _record(step: int) -> dict:
    return {"step": step, "loss": 5.0 - 0.1 * step, "lm_loss": 4.9 - 0.1 * step, "aux_loss": 0.011, "z_loss": 0.002,
            "grad_norm": 1.5, "lr": 1e-3 * step, "tokens_per_s": 1000.0 + step, "expert_load_max": 1.6,
            "expert_load_mean": 1.3, "time": 1.7e9 + step, "aux_per_layer": [1.1, 1.0], "z_per_layer": [2.0, 3.0],
            "expert_counts": [[10, 30, 20, 20], [20, 20, 20, 20]], "step_time_s": 0.25, "new_thing": 7,
            "fault": None, "mfu": 0.5 + step / 100, "mfu_gemm": None, "mem_gib": 1.5}


def _read(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_scalars_and_histograms_reach_tensorboard(tmp_path):
    with Tracker(tmp_path) as tr:
        for step in (1, 2, 3):
            written = tr.log(step, _record(step))
    assert written["perf/mfu"] == pytest.approx(0.53) and "perf/mfu_vs_measured_gemm" not in written
    acc = _read(tmp_path / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lm_loss", "moe/aux_loss", "moe/z_loss", "train/grad_norm", "train/lr",
                "perf/tokens_per_s", "perf/mfu", "perf/step_time_s", "perf/mem_gib", "moe/load_max_over_mean",
                "moe/layer0/load_max_over_mean", "moe/layer1/load_min_over_mean", "moe/layer1/z_loss",
                "misc/new_thing"):
        assert tag in tags, tag
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([4.9, 4.8, 4.7])
    assert acc.Scalars("moe/layer0/load_max_over_mean")[0].value == pytest.approx(1.5)
    assert acc.Scalars("moe/layer0/load_min_over_mean")[0].value == pytest.approx(0.5)
    hist = acc.Histograms("moe/layer0/expert_load")
    assert len(hist) == 3 and hist[0].histogram_value.num == 4
    assert hist[0].histogram_value.min == pytest.approx(0.5) and hist[0].histogram_value.max == pytest.approx(1.5)


def test_no_backends_writes_nothing(tmp_path):
    with Tracker(tmp_path, backends=()) as tr:
        assert tr.log(1, _record(1))["train/loss"] == pytest.approx(4.9)
    assert not (tmp_path / "tensorboard").exists()


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="train.tracking"):
        check_backends(["tensorboard", "mlflow"])


@pytest.mark.skipif(not installed("wandb"), reason="wandb not installed (pip install wandb)")
def test_wandb_offline_run_holds_the_scalars(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Tracker(tmp_path / "run", backends=("wandb",), config={"train": {"lr": 1e-3}}) as tr:
        for step in (1, 2):
            tr.log(step, _record(step))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    # the .wandb transaction log is W&B's own binary format (read by `wandb sync`); its history records hold the
    # tags and JSON values as plain protobuf strings
    data = next(runs[0].glob("*.wandb")).read_bytes()
    for needle in (b"train/loss", b"perf/mfu", b"moe/layer0/load_max_over_mean", b"4.8", b"0.52"):
        assert needle in data, needle


def test_pure_helpers():
    scalars, hists = to_scalars({"loss": float("nan"), "lr": 0.1, "expert_counts": [[0, 0]]})
    assert "train/loss" not in scalars and scalars["train/lr"] == 0.1
    assert hists["moe/layer0/expert_load"] == [0.0, 0.0]
    assert layer_load([1, 3]) == (1.5, 0.5, [0.5, 1.5])
    dense = ModelConfig(kind="dense", vocab_size=100, d_model=8, n_layers=2, n_heads=2, ffn_hidden=16)
    assert active_matmul_params(dense) == 2 * (4 * 64 + 3 * 8 * 16) + 800
    moe = ModelConfig(kind="moe", vocab_size=100, d_model=8, n_layers=2, n_heads=2,
                      moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=16))
    assert active_matmul_params(moe) == 2 * (4 * 64 + 2 * 3 * 8 * 16 + 8 * 8) + 800
    assert flops_per_token(dense, 10) == 6 * active_matmul_params(dense) + 6 * 2 * 10 * 8
    # the convention of Megatron-LM and torchtitan: the masked half of causal attention counted too
    assert flops_per_token(dense, 10, causal=False) == 6 * active_matmul_params(dense) + 12 * 2 * 10 * 8
    assert mfu(100.0, 2.0, None) is None and math.isclose(mfu(100.0, 2.0, 400.0), 0.5)


def test_fp8_experts_are_measured_against_the_peak_of_their_precision_mix():
    import dataclasses

    from moe_launch.conf import presets

    bf16 = presets.MODELS["olmoe_1b7b"]
    fp8 = dataclasses.replace(bf16, moe=dataclasses.replace(bf16.moe, precision="fp8"))
    m, S = bf16.moe, 4096
    routed = 6.0 * bf16.n_layers * m.top_k * 3 * bf16.d_model * m.expert_hidden  # the experts' matmuls, fwd+bwd
    assert fp8_flops_per_token(bf16) == 0 and fp8_flops_per_token(fp8) == routed * 4 / 6
    assert step_peak(bf16, S, "NVIDIA H200") == 989e12
    total, f8 = flops_per_token(fp8, S), fp8_flops_per_token(fp8)
    mixed = step_peak(fp8, S, "NVIDIA H200")
    assert math.isclose(total / mixed, (total - f8) / 989e12 + f8 / 1979e12)  # the ideal time, part by part
    assert 989e12 < mixed < 1979e12
    assert step_peak(fp8, S, "NVIDIA A100") == 312e12  # no FP8 peak on the data sheet: bf16's
    assert step_peak(fp8, S, "NVIDIA H200", override=5e14) == 5e14 and step_peak(fp8, S, "") is None


def test_peaks_from_data_sheet_override_and_preflight():
    assert spec_peak("NVIDIA H200") == 989e12 and spec_peak("NVIDIA H100 PCIe") == 756e12
    assert spec_peak("") is None and spec_peak("cpu", override=1e12) == 1e12
    preflight = {"results": [
        {"node": "n1", "check": "compute", "status": "pass", "value": 700.0},
        {"node": "n1", "check": "compute", "status": "pass", "value": 720.0},
        {"node": "n2", "check": "compute", "status": "fail", "value": 100.0},  # failed: not what the run got
        {"node": "n3", "check": "compute", "status": "pass", "value": 900.0},  # not one of the run's nodes
        {"node": "n1", "check": "alltoall", "status": "pass", "value": 50.0},
    ]}
    assert measured_gemm_rate(preflight, ["n1", "n2"]) == pytest.approx(710e12)
    assert measured_gemm_rate(preflight, ["n9"]) is None and measured_gemm_rate({}, ["n1"]) is None
