"""Held-out evaluation (trainer/evaluate.py): when it runs, the config and launch-time checks that name its keys, the
loss it reports against a direct computation on the same weights, training bitwise unchanged by it, and DP=2 on
gloo ranks reporting what DP=1 does."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_harness import SEQ, VOCAB, launch_ranks, tiny_cfg, write_run

from moe_launch.conf.schema import ClusterConfig, DataConfig, ParallelConfig, TrainConfig
from moe_launch.errors import ConfigError, DataError
from moe_launch.rundir import EXIT_OK, EXIT_PREEMPTED, read_jsonl
from moe_launch.trainer.data import shards
from moe_launch.trainer.data.check import check_data
from moe_launch.trainer.evaluate import eval_due, format_eval_line
from moe_launch.trainer.loop import Trainer
from moe_launch.trainer.tracking.scalars import to_scalars

torch.set_num_threads(1)


def _heldout(root: Path, n: int = 16, seed: int = 7) -> Path:
    """n random sequences of SEQ+1 tokens, prepared as `moe-data prepare` writes them."""
    root.mkdir(parents=True, exist_ok=True)
    rows_NL = np.random.default_rng(seed).integers(0, VOCAB, size=(n, SEQ + 1)).astype(shards.token_dtype(VOCAB))
    shards.write_shard(root, 0, rows_NL)
    shards.write_index(root, shards.ShardIndex(
        seq_len=SEQ, dtype=str(rows_NL.dtype), vocab_size=VOCAB, eos_id=0, max_token_id=int(rows_NL.max()),
        shards=[{"file": shards.shard_name(0), "count": n}], tokenizer="random", seed=seed, shard_size=n,
        total_tokens=int(rows_NL.size)))
    return root


def _with_eval(cfg, path: Path, interval: int, batches: int):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_interval=interval, eval_batches=batches),
                               data=dataclasses.replace(cfg.data, eval_path=str(path)))


def test_eval_runs_every_interval_and_after_the_last_step():
    assert [d for d in range(1, 11) if eval_due(d, 4, 10)] == [4, 8, 10]
    assert [d for d in range(1, 9) if eval_due(d, 4, 8)] == [4, 8]
    assert not any(eval_due(d, 0, 10) for d in range(1, 11))
    line = format_eval_line({"step": 4, "eval_lm_loss": 2.0, "eval_ppl": math.exp(2.0), "eval_sequences": 8,
                             "eval_s": 0.25})
    assert line == "eval after step 4: lm loss 2.0000 (ppl 7.39) over 8 held-out sequences, 0.2 s"
    scalars, _ = to_scalars({"step": 4, "eval_lm_loss": 2.0, "eval_ppl": 7.39, "eval_sequences": 8, "eval_s": 0.25,
                             "time": 1.0})
    assert scalars == {"eval/lm_loss": 2.0, "eval/ppl": 7.39, "eval/sequences": 8.0, "eval/seconds": 0.25}


def test_eval_settings_are_checked_with_their_keys(tmp_path, data_cache):
    with pytest.raises(ConfigError, match="data.eval_path.*train.eval_interval=2"):
        tiny_cfg(data_cache, eval_interval=2)
    with pytest.raises(ConfigError, match="train.eval_batches"):
        TrainConfig(eval_batches=0)
    with pytest.raises(ConfigError, match="train.eval_interval"):
        TrainConfig(eval_interval=-1)
    cfg = _with_eval(tiny_cfg(data_cache), tmp_path, 2, 1)
    with pytest.raises(ConfigError, match="train.eval_interval.*pipeline parallelism"):
        dataclasses.replace(cfg, parallel=ParallelConfig(pp=2, microbatches=2),
                            cluster=ClusterConfig(kind="local", nodes=2, tasks_per_node=1))


def test_launch_check_names_data_eval_path(tmp_path):
    _heldout(tmp_path / "held", n=6)
    with pytest.raises(DataError, match="data.eval_path=.*nowhere"):
        check_data(DataConfig(eval_path="nowhere"), SEQ, VOCAB, tmp_path, eval_sequences=4)
    with pytest.raises(DataError, match="data.eval_path=.*6 sequences .* fewer than the 8 of train.eval_batches"):
        check_data(DataConfig(eval_path="held"), SEQ, VOCAB, tmp_path, eval_sequences=8)
    with pytest.raises(DataError, match="data.eval_path=.*token id .* model.vocab_size=16"):
        check_data(DataConfig(eval_path="held"), SEQ, 16, tmp_path, eval_sequences=4)
    ok = check_data(DataConfig(eval_path="held"), SEQ, VOCAB, tmp_path, eval_sequences=6)
    assert ok.eval_path == str(tmp_path / "held")  # relative to the launch directory, made absolute
    # evaluation off: the held-out path is not read at all
    assert check_data(DataConfig(eval_path="nowhere"), SEQ, VOCAB, tmp_path).eval_path == str(tmp_path / "nowhere")


def test_trainer_refuses_too_few_held_out_sequences(tmp_path, data_cache):
    cfg = _with_eval(tiny_cfg(data_cache, steps=2, ckpt_interval=0), _heldout(tmp_path / "held", n=6), 1, 2)
    with pytest.raises(DataError, match="data.eval_path=.*6 sequences, fewer than the 8"):
        Trainer(cfg, write_run(tmp_path / "run", cfg))


def test_a_stopping_step_checkpoints_without_evaluating(tmp_path, data_cache):
    cfg = _with_eval(tiny_cfg(data_cache, steps=3, ckpt_interval=0), _heldout(tmp_path / "held"), 1, 1)
    rd = write_run(tmp_path / "run", cfg)
    trainer = Trainer(cfg, rd)
    trainer.stop_requested = True  # as the SIGUSR2 / SIGTERM handler sets it
    assert trainer.train() == EXIT_PREEMPTED
    assert [r["step"] for r in read_jsonl(rd.metrics)] == [1] and not rd.evals.exists()


def _direct_loss(model: torch.nn.Module, path: Path, sequences: int, micro: int) -> float:
    rows = np.concatenate([np.asarray(s) for s in shards.open_shards(path, shards.read_index(path))])[:sequences]
    losses = []
    with torch.no_grad():
        for mb in torch.from_numpy(rows.astype(np.int64)).split(micro):
            losses.append(float(model.compute_loss(mb[:, :-1], mb[:, 1:])[1].lm_loss))
    return sum(losses) / len(losses)


def test_trainer_reports_the_held_out_loss_and_trains_bitwise_as_without(tmp_path, data_cache):
    held = _heldout(tmp_path / "held")
    plain_cfg = tiny_cfg(data_cache, steps=3, ckpt_interval=0)
    plain = write_run(tmp_path / "plain", plain_cfg)
    assert Trainer(plain_cfg, plain).train() == EXIT_OK
    cfg = _with_eval(plain_cfg, held, interval=2, batches=2)
    rd = write_run(tmp_path / "eval", cfg)
    trainer = Trainer(cfg, rd)
    assert trainer.train() == EXIT_OK

    steps = read_jsonl(rd.metrics)
    assert [r["loss"] for r in steps] == [r["loss"] for r in read_jsonl(plain.metrics)]  # bitwise: no side effects
    assert [r["grad_norm"] for r in steps] == [r["grad_norm"] for r in read_jsonl(plain.metrics)]
    evals = read_jsonl(rd.evals)
    assert [e["step"] for e in evals] == [2, 3] and all(e["eval_sequences"] == 8 for e in evals)
    assert evals[0]["eval_lm_loss"] != evals[1]["eval_lm_loss"]  # the weights moved in between
    # the last evaluation ran on the final weights: the same loss computed directly over the same 8 sequences
    want = _direct_loss(trainer.model, held, 8, cfg.train.micro_batch_size)
    assert math.isclose(evals[-1]["eval_lm_loss"], want, rel_tol=1e-6), (evals[-1], want)
    assert all("eval" not in r for r in steps)  # metrics.jsonl keeps its step records only


def test_dp2_reports_the_held_out_loss_of_dp1(tmp_path, data_cache):
    held = _heldout(tmp_path / "held")
    one_cfg = _with_eval(tiny_cfg(data_cache, steps=2, ckpt_interval=0), held, interval=1, batches=2)
    one = write_run(tmp_path / "dp1", one_cfg)
    assert Trainer(one_cfg, one).train() == EXIT_OK
    two = write_run(tmp_path / "dp2", _with_eval(tiny_cfg(data_cache, dp=2, steps=2, ckpt_interval=0), held, 1, 2))
    procs = launch_ranks(two, world=2)
    assert [p.returncode for p in procs] == [EXIT_OK, EXIT_OK], procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    e1, e2 = read_jsonl(one.evals), read_jsonl(two.evals)
    assert [e["step"] for e in e2] == [1, 2]
    for a, b in zip(e1, e2):
        assert math.isclose(a["eval_lm_loss"], b["eval_lm_loss"], rel_tol=1e-5), (a, b)
    assert "eval after step 2: lm loss" in procs[0].stdout and "eval after step" not in procs[1].stdout
