"""Spike detection (train.spike): the robust limit, the step -> batch map around skipped data, and the three actions
through the real trainer: skip (dp=2 ranks stay in lockstep on a spike seen by one rank), rollback (exit, restart
from the newest model checkpoint before the spike at its step with a fresh optimizer, the spike's batch never read
again), and a spike that recurs after the rollback stops as a data/model problem."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_harness import launch_ranks, tiny_cfg, write_run

from moe_launch.conf.schema import FaultInjection, SpikeConfig, TrainConfig
from moe_launch.errors import ConfigError
from moe_launch.rundir import EXIT_OK, EXIT_ROLLBACK, EXIT_SPIKE, read_jsonl
from moe_launch.trainer.spike import ROLLBACK_FILE, RollbackState, SpikeDetector, batch_for_step, spike_limit

torch.set_num_threads(1)
# generous: a tiny model's early grad norms wobble; the injected spike is SPIKE_FACTOR = 1000x
SPIKE = dict(window=4, threshold=30.0)


def test_limit_is_median_plus_scaled_mad_and_ignores_outliers_in_the_window():
    med, limit = spike_limit([1.0, 2.0, 3.0, 100.0, 2.0], 3.0)
    assert med == 2.0 and limit == pytest.approx(2.0 + 3.0 * 1.4826 * 1.0)
    med, limit = spike_limit([5.0] * 4, 6.0)  # a flat window still has a (tiny) width
    assert med == 5.0 and 5.0 < limit < 5.001


def test_detector_waits_for_a_full_window_and_keeps_spikes_out_of_its_history():
    det = SpikeDetector(SpikeConfig(action="skip", window=3, threshold=6.0))
    assert det.observe(1, 50.0, 1.0) is None  # nothing is judged before the window is full
    for step, loss in ((2, 4.0), (3, 4.1)):
        assert det.observe(step, loss, 1.0) is None
    spike = det.observe(4, 40.0, 1.0)
    assert spike is not None and spike.metric == "loss" and spike.step == 4
    assert list(det.loss) == [50.0, 4.0, 4.1]
    spike = det.observe(5, 4.0, 9.0)
    assert spike is not None and spike.metric == "grad_norm"
    assert det.observe(6, 3.9, 1.0) is None and list(det.loss) == [4.0, 4.1, 3.9]


def test_steps_map_onto_the_batches_that_were_not_skipped():
    skips = [(9, 9), (3, 4)]
    assert [batch_for_step(s, skips) for s in range(8)] == [0, 1, 2, 5, 6, 7, 8, 10]
    assert [batch_for_step(s, []) for s in range(3)] == [0, 1, 2]
    assert [batch_for_step(s, [(3, 4), (4, 6)]) for s in range(5)] == [0, 1, 2, 7, 8]  # overlapping windows


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError) as err:
        SpikeConfig(action="ignore")
    assert err.value.key == "train.spike.action"
    with pytest.raises(ConfigError) as err:
        TrainConfig(spike=SpikeConfig(action="rollback"))
    assert err.value.key == "train.spike.action" and "model_ckpt_interval" in str(err.value)


def _spikes(rd) -> list[dict]:
    return [e["details"] for e in read_jsonl(rd.journal) if e["kind"] == "spike"]


def test_skip_drops_the_update_on_every_rank_in_lockstep(tmp_path, data_cache):
    """The spike is injected on rank 1 only; the decision comes from the reduced loss, so both ranks skip."""
    cfg = tiny_cfg(data_cache, dp=2, steps=8, ckpt_interval=0, spike=SpikeConfig(action="skip", **SPIKE),
                   fault_injection=FaultInjection(kind="loss_spike", rank=1, step=6))
    rd = write_run(tmp_path / "run", cfg)
    procs = launch_ranks(rd, world=2)
    assert [p.returncode for p in procs] == [EXIT_OK, EXIT_OK], procs[0].stdout[-3000:] + procs[1].stdout[-3000:]
    spikes = _spikes(rd)
    assert [(s["step"], s["action"]) for s in spikes] == [(6, "skip")], spikes
    assert spikes[0]["value"] > 100 * spikes[0]["median"]
    losses = {r["step"]: r["loss"] for r in read_jsonl(rd.metrics)}
    assert sorted(losses) == list(range(1, 9)) and losses[7] < 2 * losses[5]  # the spike left no trace


def _rollback_cfg(data_cache, attempt: int):
    return tiny_cfg(data_cache, steps=12, ckpt_interval=2, model_ckpt_interval=4,
                    spike=SpikeConfig(action="rollback", **SPIKE),
                    fault_injection=FaultInjection(kind="loss_spike", rank=0, step=10, attempt=attempt))


def test_rollback_restarts_from_the_model_checkpoint_before_the_spike_and_skips_its_batch(tmp_path, data_cache):
    from moe_launch.trainer.loop import Trainer

    cfg = _rollback_cfg(data_cache, attempt=0)
    rd = write_run(tmp_path / "run", cfg)
    assert Trainer(cfg, rd, attempt=0).train() == EXIT_ROLLBACK
    (spike,) = _spikes(rd)
    assert spike["step"] == 10 and spike["action"] == "rollback" and spike["restart_step"] == 8
    assert spike["rollback_to"].endswith("model-step-8") and spike["skip_batches"] == [9, 9]
    state = json.loads((rd.root / ROLLBACK_FILE).read_text())
    assert state["skips"] == [[9, 9]] and state["spikes"] == [10]

    # attempt 1: no injection; the full checkpoint of step 8 (ckpt-b) is older than the rollback, so it is ignored
    trainer = Trainer(cfg, rd, attempt=1)
    assert trainer.start_step == 8 and trainer.optimizer.step_count == 0
    assert trainer.rollback.skips == [(9, 9)]
    assert [batch_for_step(s, trainer.rollback.skips) for s in (8, 9, 10)] == [8, 10, 11]
    assert trainer.train() == EXIT_OK
    resume = [e["details"] for e in read_jsonl(rd.journal) if e["kind"] == "resume"][-1]
    assert resume["rollback"] and resume["fresh_optimizer"] and resume["step"] == 8
    # a later crash resumes from the full checkpoint written after the rollback, not from the rollback again
    later = Trainer(cfg, rd, attempt=2)
    assert later.rollback.pending is None and later.start_step == 12 and later.rollback.skips == [(9, 9)]
    # a new run started from the rolled-back run's weights keeps its step -> batch map
    fresh = tiny_cfg(data_cache, steps=14, ckpt_interval=0)
    fresh.model.init_from = f"ckpt:{rd.checkpoints / 'model-step-12'}"
    child = Trainer(fresh, write_run(tmp_path / "child", fresh))
    assert child.start_step == 12 and child.rollback.skips == [(9, 9)]


def test_a_spike_that_recurs_after_rollback_is_a_data_or_model_problem(tmp_path, data_cache):
    from moe_launch.trainer.loop import Trainer

    cfg = _rollback_cfg(data_cache, attempt=0)
    rd = write_run(tmp_path / "run", cfg)
    assert Trainer(cfg, rd, attempt=0).train() == EXIT_ROLLBACK
    again = _rollback_cfg(data_cache, attempt=1)  # the same spike at the same step after the rollback
    assert Trainer(again, rd, attempt=1).train() == EXIT_SPIKE
    last = _spikes(rd)[-1]
    assert last["step"] == 10 and last["action"] == "stop" and "data/model problem" in last["what"]
    assert RollbackState.read(rd.root).spikes == [10]  # no second rollback was planned


def test_rollback_without_a_model_checkpoint_before_the_spike_stops(tmp_path, data_cache):
    from moe_launch.trainer.loop import Trainer

    cfg = tiny_cfg(data_cache, steps=8, ckpt_interval=0, model_ckpt_interval=8,
                   spike=SpikeConfig(action="rollback", **SPIKE),
                   fault_injection=FaultInjection(kind="loss_spike", rank=0, step=6))
    rd = write_run(tmp_path / "run", cfg)
    assert Trainer(cfg, rd).train() == EXIT_SPIKE
    assert "no persistent model checkpoint" in _spikes(rd)[-1]["what"]


def test_stop_exits_with_the_diagnosis_before_the_update(tmp_path, data_cache):
    from moe_launch.trainer.loop import Trainer

    cfg = tiny_cfg(data_cache, steps=8, ckpt_interval=2, spike=SpikeConfig(action="stop", **SPIKE),
                   fault_injection=FaultInjection(kind="loss_spike", rank=0, step=7))
    rd = write_run(tmp_path / "run", cfg)
    trainer = Trainer(cfg, rd)
    assert trainer.train() == EXIT_SPIKE
    (spike,) = _spikes(rd)
    assert spike["step"] == 7 and spike["action"] == "stop" and "above" in spike["what"]
    assert trainer.optimizer.step_count == 6  # the spiking step was not applied
    assert not (rd.root / ROLLBACK_FILE).exists()


def test_rollback_yields_only_to_a_checkpoint_captured_after_it():
    """A checkpoint of a step before the spike may finish writing after it (asynchronous persistence): what counts
    is when its state was captured."""
    from moe_launch.trainer.spike import rollback_applies

    pending = {"checkpoint": "model-step-6", "step": 6, "time": 100.0}
    assert rollback_applies(pending, None) and rollback_applies(pending, 99.0)
    assert not rollback_applies(pending, 101.0) and not rollback_applies(None, 99.0)


def test_judge_spike_rolls_back_once_then_calls_a_recurrence_a_data_or_model_problem(tmp_path):
    from moe_launch.trainer.spike import Spike, judge_spike

    cfg = SpikeConfig(action="rollback", window=5, skip_batches=2)
    spike = Spike(step=10, metric="loss", value=60.0, median=6.0, limit=7.0)
    fresh = RollbackState(skips=[], pending=None, spikes=[])
    first = judge_spike(spike, cfg, fresh, 0, 9, (6, tmp_path / "model-step-6"))
    assert first.action == "rollback" and first.plan.step == 6 and first.plan.skip == (8, 9)
    after = fresh.with_rollback(first.plan, 10, 1.0, {})
    again = judge_spike(spike, cfg, after, 6, 11, (6, tmp_path / "model-step-6"))
    assert again.action == "stop" and "data/model problem" in again.why and again.plan is None
    later = Spike(step=40, metric="loss", value=60.0, median=6.0, limit=7.0)  # far past the earlier spike: new
    assert judge_spike(later, cfg, after, 6, 41, (36, tmp_path / "model-step-36")).action == "rollback"
    assert judge_spike(spike, cfg, fresh, 0, 9, None).action == "stop"
    assert judge_spike(spike, SpikeConfig(action="stop"), fresh, 0, 9, None).action == "stop"
