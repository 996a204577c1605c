"""Training health under pipeline parallelism (pp=2): a loss spike injected on the last stage is judged on the loss
every stage shares, so both stages skip the same update; aux_free_bias updates each stage's routers from that
stage's own layers' loads (the pipeline reports every layer's), and both stages' biases are checkpointed."""

from __future__ import annotations

import dataclasses

import pytest
from test_trainer_pp import _ok, pp_cfg
from trainer_harness import launch_ranks, write_run

from moe_launch.conf.schema import FaultInjection, SpikeConfig
from moe_launch.rundir import read_jsonl
from moe_launch.trainer.checkpoint.store import choose_resume_slot, load_file


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data-cache"))


def test_pipeline_skips_a_spike_in_lockstep_and_learns_each_stages_bias(tmp_path, data_cache):
    cfg = pp_cfg(data_cache, steps=8, ckpt_interval=8, spike=SpikeConfig(action="skip", window=4, threshold=30.0),
                 fault_injection=FaultInjection(kind="loss_spike", rank=1, step=6))
    cfg.model.moe = dataclasses.replace(cfg.model.moe, balance="aux_free_bias")
    rd = write_run(tmp_path / "run", cfg)
    _ok(launch_ranks(rd, world=2))
    spikes = [e["details"] for e in read_jsonl(rd.journal) if e["kind"] == "spike"]
    assert [(s["step"], s["action"]) for s in spikes] == [(6, "skip")], spikes
    slot = choose_resume_slot(rd.checkpoints).path
    for stage in (0, 1):
        saved = load_file(slot, f"model/pp{stage}/dense.pt")
        biases = {n: t for n, t in saved.items() if n.endswith("expert_bias_E")}
        assert len(biases) == 1 and all(float(b.abs().sum()) > 0 for b in biases.values()), (stage, list(saved))
