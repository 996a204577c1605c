"""Stage construction: layer splits (given or balanced by parameter count) and stage weights equal to the slices of
the unpipelined model built after the same seed."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_launch.conf.schema import ModelConfig, MoEConfig, ParallelConfig
from moe_launch.errors import ConfigError
from moe_launch.trainer.model import build_model
from moe_launch.trainer.pipeline.split import balanced_split, check_split, chunk_layers
from moe_launch.trainer.pipeline.stage import balance_costs, build_stage_model, parameter_counts


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=16, n_layers=6, n_heads=2, max_seq_len=16,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=8), **kw)


def test_balanced_split_minimises_the_largest_chunk():
    assert balanced_split([1.0] * 8, 2) == [range(0, 4), range(4, 8)]
    assert balanced_split([1.0] * 7, 3) == [range(0, 2), range(2, 4), range(4, 7)]  # ties: earliest cuts
    # a heavy embedding (worth two layers) on chunk 0 moves layers to the other chunks
    assert balanced_split([1.0] * 8, 2, first_extra=2.0) == [range(0, 3), range(3, 8)]
    # embedding and head worth a layer each: the largest chunk costs 3 (total 10 over 4 chunks)
    assert balanced_split([1.0] * 8, 4, first_extra=1.0, last_extra=1.0) == [range(0, 1), range(1, 3), range(3, 6),
                                                                              range(6, 8)]
    with pytest.raises(ConfigError, match="parallel.pp"):
        balanced_split([1.0] * 3, 4)


def test_given_split_and_its_errors():
    assert check_split([0, 3, 3], 6, 3) == [range(0, 0), range(0, 3), range(3, 6)]
    for bad in ([3, 3], [2, 2, 3], [3, 0, 3]):
        with pytest.raises(ConfigError, match="parallel.pp_split"):
            check_split(bad, 6, 3)
    with pytest.raises(ConfigError, match="parallel.pp_split"):
        ParallelConfig(pp=2, pp_split=[1, 2, 3])


def test_param_balance_counts_embedding_and_head():
    cfg = ModelConfig(vocab_size=4096, d_model=64, n_layers=8, n_heads=4, max_seq_len=16,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=64))
    layers, embed, head = parameter_counts(cfg)
    full = build_model(cfg)
    assert sum(layers) + embed + head == sum(p.numel() for p in full.parameters())
    assert balance_costs(cfg, "params") == ([float(n) for n in layers], float(embed), float(head))
    by_layers = chunk_layers(8, 4, [], *balance_costs(cfg, "layers"))
    by_params = chunk_layers(8, 4, [], *balance_costs(cfg, "params"))
    assert by_layers == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]

    def worst(ranges):
        return max(sum(layers[i] for i in r) + (embed if c == 0 else 0) + (head if c == 3 else 0)
                   for c, r in enumerate(ranges))

    # the optimum over every contiguous split into 4 non-empty chunks (brute force)
    optimum = min(worst([range(0, a), range(a, b), range(b, c), range(c, 8)])
                  for a, b, c in itertools.combinations(range(1, 8), 3))
    assert worst(by_params) == optimum < worst(by_layers)
    # embedding and head are each worth ~4 layers here: the end chunks get a single layer
    assert len(by_params[0]) == len(by_params[-1]) == 1


def test_flops_balance_weighs_active_experts_and_the_head():
    olmoe = ModelConfig(vocab_size=50304, d_model=2048, n_layers=8, n_heads=16, max_seq_len=4096,
                        moe=MoEConfig(num_experts=64, top_k=8, expert_hidden=1024))
    layers, embed, head = balance_costs(olmoe, "flops")
    assert embed == 0 and 1.3 < head / layers[0] < 1.7  # the head costs about 1.5 layers of compute
    # PP=2: the head's stage gets 3 layers (3 + 1.5 vs 5), where parameter balance (all 64 experts count) gives 4 / 4
    assert chunk_layers(8, 2, [], *balance_costs(olmoe, "flops")) == [range(0, 5), range(5, 8)]
    assert chunk_layers(8, 2, [], *balance_costs(olmoe, "params")) == [range(0, 4), range(4, 8)]
    with pytest.raises(ConfigError, match="parallel.pp_balance"):
        balance_costs(olmoe, "bytes")


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_stages_hold_exactly_the_slices_of_the_unpipelined_model(kind):
    cfg = _cfg(kind=kind)
    torch.manual_seed(5)
    full = build_model(cfg, ep_rank=1, ep_size=2).state_dict()
    ranges = [range(0, 2), range(2, 3), range(3, 5), range(5, 6)]  # chunks 0..3; stage s holds s and s+2
    names: set[str] = set()
    for stage in (0, 1):
        torch.manual_seed(5)
        model = build_stage_model(cfg, {c: ranges[c] for c in (stage, stage + 2)}, 4, ep_rank=1, ep_size=2)
        for name, value in model.state_dict().items():
            assert torch.equal(value, full[name]), name
            assert name not in names
            names.add(name)
    assert names == set(full)


def test_root_config_checks_for_pipelines():
    from moe_launch.conf.schema import ClusterConfig, RootConfig, TrainConfig

    def root(**parallel):
        p = ParallelConfig(**parallel)
        return RootConfig(parallel=p, cluster=ClusterConfig(nodes=p.world_size),
                          train=TrainConfig(global_batch_size=8, micro_batch_size=2))

    assert root(pp=2, microbatches=4).parallel.microbatches == 4  # 8 / (1 * 2) micro-batches per pipeline
    with pytest.raises(ConfigError, match="parallel.microbatches=4"):
        root(pp=2, microbatches=2)
    with pytest.raises(ConfigError, match="parallel.pp:"):
        root(pp=2, microbatches=4, pp_schedule="interleaved", pp_virtual_stages=2)  # 2 layers, 4 chunks
    with pytest.raises(ConfigError, match="parallel.pp_balance"):
        ParallelConfig(pp_balance="bytes")
