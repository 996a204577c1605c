"""bf16 parameters (`train.param_dtype`): the resolution and its config checks, a bf16-parameter run that learns with
fp32 masters inside the optimizer, a bitwise crash-resume of such a run, and model weights crossing parameter dtypes
(model-only checkpoints, full resume refused with a config error)."""

from __future__ import annotations

import pytest
import torch
from trainer_harness import tiny_cfg, write_run

from moe_launch.conf.schema import FaultInjection, TrainConfig
from moe_launch.errors import ConfigError
from moe_launch.rundir import EXIT_OK, read_jsonl
from moe_launch.trainer.checkpoint.store import load_file
from moe_launch.trainer.dtypes import cast_parameters, compute_dtype, param_dtype
from moe_launch.trainer.faults import InjectedCrash
from moe_launch.trainer.loop import Trainer
from moe_launch.trainer.model import build_model

torch.set_num_threads(1)

BF16 = dict(dtype="bf16", param_dtype="bf16")


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _losses(rd, after: int = 0) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(rd.metrics) if r["step"] > after}  # later lines win


# -- resolution and validation (pure) ------------------------------------------------------------------------------
def test_param_dtype_follows_compute_dtype_and_rejects_bf16_over_fp32():
    assert param_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert param_dtype("auto", torch.float32) == torch.float32
    assert param_dtype("fp32", torch.bfloat16) == torch.float32
    assert param_dtype("bf16", torch.bfloat16) == torch.bfloat16
    # train.dtype=auto is fp32 on CPU: only the device knows, so the trainer's resolution raises
    with pytest.raises(ConfigError) as err:
        param_dtype("bf16", compute_dtype("auto", torch.device("cpu")))
    assert err.value.key == "train.param_dtype" and "train.dtype=bf16" in str(err.value)

    with pytest.raises(ConfigError) as err:
        TrainConfig(dtype="fp32", param_dtype="bf16")
    assert err.value.key == "train.param_dtype" and "train.dtype=fp32" in str(err.value)
    with pytest.raises(ConfigError) as err:
        TrainConfig(param_dtype="fp16")
    assert err.value.key == "train.param_dtype" and "auto, fp32, bf16" in str(err.value)
    TrainConfig(dtype="auto", param_dtype="bf16")  # fine on a GPU, so the config accepts it


def test_cast_parameters_keeps_the_parameters_and_leaves_buffers(data_cache):
    model = build_model(tiny_cfg(data_cache).model, 0, 1, torch.device("cpu"))
    before = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in before.items()}
    cast_parameters(model, torch.bfloat16)
    after = dict(model.named_parameters())
    assert all(after[n] is p and p.dtype == torch.bfloat16 for n, p in before.items())  # same objects, cast
    assert all(torch.equal(after[n].detach(), v.bfloat16()) for n, v in values.items())
    assert after["blocks.0.ffn.w_gate_EFD"]._moe_expert  # flags stay on the parameter
    buffers = dict(model.named_buffers())
    assert buffers and all(b.dtype == torch.float32 for b in buffers.values())  # rotary tables stay fp32


# -- training --------------------------------------------------------------------------------------------------------
def test_bf16_parameters_train_with_fp32_masters(data_cache, tmp_path):
    cfg = tiny_cfg(data_cache, steps=12, ckpt_interval=0, **BF16)
    rd = write_run(tmp_path / "r", cfg)
    trainer = Trainer(cfg, rd)
    assert trainer.param_dtype == torch.bfloat16
    assert trainer.train() == EXIT_OK

    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {p.grad.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert all(b.dtype == torch.float32 for b in trainer.model.buffers())
    buckets = trainer.optimizer.state_dict()["buckets"]
    assert buckets and all(s[k].dtype == torch.float32 for s in buckets.values()
                           for k in ("master", "exp_avg", "exp_avg_sq"))
    # the masters carry the bits that bf16 parameters cannot hold: updates smaller than a bf16 step accumulate
    master = torch.cat([s["master"] for s in buckets.values()])
    assert (master != master.bfloat16().float()).float().mean() > 0.5

    losses = [r["loss"] for r in read_jsonl(rd.metrics)]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses


def test_bf16_parameter_run_resumes_bitwise(data_cache, tmp_path):
    cfg = tiny_cfg(data_cache, **BF16)
    ref = write_run(tmp_path / "ref", cfg)
    uninterrupted = Trainer(cfg, ref)
    assert uninterrupted.train() == EXIT_OK

    crash = tiny_cfg(data_cache, fault_injection=FaultInjection(kind="crash", rank=0, step=7, attempt=0), **BF16)
    run = write_run(tmp_path / "run", crash)
    with pytest.raises(InjectedCrash):
        Trainer(crash, run, attempt=0).train()
    saved = load_file(run.checkpoints / "ckpt-a", "model/dense.pt")  # step 6
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    resumed = Trainer(crash, run, attempt=1)
    assert resumed.start_step == 6
    assert resumed.train() == EXIT_OK

    assert _losses(run, 6) == {s: v for s, v in _losses(ref).items() if s > 6}
    ref_params, got_params = _params(uninterrupted), _params(resumed)
    assert all(torch.equal(ref_params[n], got_params[n]) for n in ref_params)
    ref_opt, got_opt = uninterrupted.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert ref_opt["step"] == got_opt["step"] == 8
    for name, s in ref_opt["buckets"].items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s[key], got_opt["buckets"][name][key]), (name, key)


# -- weights across parameter dtypes ---------------------------------------------------------------------------------
def _model_checkpoint(data_cache, tmp_path, name: str, **train):
    """A 2-step run that leaves checkpoints/model-step-2 (and a full checkpoint of step 2); returns (run dir,
    trainer)."""
    cfg = tiny_cfg(data_cache, steps=2, ckpt_interval=2, model_ckpt_interval=2, **train)
    rd = write_run(tmp_path / name, cfg)
    trainer = Trainer(cfg, rd)
    assert trainer.train() == EXIT_OK
    return rd, trainer


@pytest.mark.parametrize("src, dst", [("bf16", "fp32"), ("fp32", "bf16")])
def test_model_checkpoint_loads_into_the_other_param_dtype(data_cache, tmp_path, src, dst):
    rd, writer = _model_checkpoint(data_cache, tmp_path, "src", dtype="bf16", param_dtype=src)
    want = torch.bfloat16 if dst == "bf16" else torch.float32
    saved = load_file(rd.checkpoints / "model-step-2", "model/dense.pt")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16 if src == "bf16" else torch.float32}

    cfg = tiny_cfg(data_cache, steps=3, ckpt_interval=0, dtype="bf16", param_dtype=dst)
    cfg.model.init_from = f"ckpt:{rd.checkpoints / 'model-step-2'}"
    loaded = Trainer(cfg, write_run(tmp_path / "dst", cfg))
    assert loaded.start_step == 2 and loaded.optimizer.step_count == 0
    src_params = _params(writer)
    for name, p in loaded.model.named_parameters():
        assert p.dtype == want
        # bf16 -> fp32 is exact; fp32 -> bf16 is the rounding the cast gives
        assert torch.equal(p.detach(), src_params[name].to(want)), name
    masters = loaded.optimizer.state_dict()["buckets"]
    assert all(s["master"].dtype == torch.float32 for s in masters.values())
    assert loaded.train() == EXIT_OK


def test_full_resume_with_another_param_dtype_is_a_config_error(data_cache, tmp_path):
    rd, _ = _model_checkpoint(data_cache, tmp_path, "src", **BF16)
    cfg = tiny_cfg(data_cache, steps=4, ckpt_interval=2, dtype="bf16", param_dtype="fp32")
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, rd, attempt=1)
    assert err.value.key == "train.param_dtype"
    assert "train.param_dtype=bf16" in str(err.value) and "model.init_from=ckpt:" in str(err.value)


def test_hf_export_of_bf16_parameters_round_trips_into_an_fp32_run(data_cache, tmp_path):
    from moe_launch.trainer.interop.gather import full_state_from_checkpoint
    from moe_launch.trainer.interop.hf import export_hf
    from moe_launch.trainer.interop.hf_config import read_hf_config

    rd, writer = _model_checkpoint(data_cache, tmp_path, "src", **BF16)
    state, model_cfg = full_state_from_checkpoint(rd.checkpoints / "model-step-2")
    out = export_hf(state, model_cfg, tmp_path / "hf")  # as stored: bf16
    assert read_hf_config(out)["torch_dtype"] == "bfloat16"

    cfg = tiny_cfg(data_cache, steps=1, ckpt_interval=0, dtype="bf16", param_dtype="fp32")
    cfg.model.init_from = f"hf:{out}"
    loaded = Trainer(cfg, write_run(tmp_path / "dst", cfg))
    src_params = _params(writer)
    for name, p in loaded.model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), src_params[name].float()), name

