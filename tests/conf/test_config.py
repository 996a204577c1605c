"""Config validation: every impossible value is rejected with its dotted key and a fix, before anything starts."""

import dataclasses

import pytest

from moe_launch.conf import presets
from moe_launch.conf.load import dump_config, load_config
from moe_launch.conf.schema import (
    ClusterConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RootConfig,
    TrainConfig,
)
from moe_launch.errors import ConfigError


def _root(**groups):
    base = dict(
        model=presets.MODELS["tiny_moe"],
        cluster=ClusterConfig(nodes=2, tasks_per_node=1),
        parallel=ParallelConfig(dp=2),
        train=TrainConfig(global_batch_size=8, micro_batch_size=4),
    )
    base.update(groups)
    return RootConfig(**base)


def test_presets_are_valid_and_roundtrip(tmp_path):
    for name, model in presets.MODELS.items():
        cfg = _root(model=model, parallel=ParallelConfig(dp=2))
        dump_config(cfg, tmp_path / f"{name}.yaml")
        assert load_config(tmp_path / f"{name}.yaml") == cfg


def test_olmoe_preset_matches_the_published_shape():
    m = presets.MODELS["olmoe_1b7b"]
    assert (m.n_layers, m.d_model, m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden, m.vocab_size) == (
        16, 2048, 64, 8, 1024, 50304)
    tiny = presets.MODELS["tiny_moe"]
    assert (tiny.moe.num_experts, tiny.moe.top_k) == (8, 2)


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: _root(parallel=ParallelConfig(dp=1, ep=3), cluster=ClusterConfig(nodes=3)), "parallel.ep"),
        (lambda: _root(parallel=ParallelConfig(dp=3)), "parallel.dp"),
        (lambda: _root(train=TrainConfig(global_batch_size=6, micro_batch_size=4)), "train.global_batch_size"),
        (lambda: _root(train=TrainConfig(seq_len=4096)), "train.seq_len"),
        (lambda: MoEConfig(num_experts=8, top_k=9), "model.moe.top_k"),
        (lambda: MoEConfig(impl="cuda"), "model.moe.impl"),
        (lambda: ModelConfig(d_model=100, n_heads=3), "model.n_heads"),
        (lambda: ModelConfig(init_from="/no/scheme"), "model.init_from"),
        (lambda: TrainConfig(min_lr=1.0, lr=0.1), "train.min_lr"),
        (lambda: TrainConfig(recompute=["attention", "everything"]), "train.recompute[1]"),
        (lambda: ClusterConfig(nodes=0), "cluster.nodes"),
        (lambda: ClusterConfig(extra_sbatch=["-x node1"]), "cluster.extra_sbatch[0]"),
        (lambda: ParallelConfig(optimizer_sharding="zero3"), "parallel.optimizer_sharding"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(make, key):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.key == key
    assert str(err.value).startswith(key + ":")
    assert "Fix:" in str(err.value)


def test_dense_model_rejects_expert_parallelism():
    with pytest.raises(ConfigError, match="parallel.ep"):
        _root(model=presets.MODELS["tiny_dense"], parallel=ParallelConfig(dp=1, ep=2))


def test_load_rejects_bad_yaml_value(tmp_path):
    cfg = _root()
    path = tmp_path / "config.yaml"
    dump_config(dataclasses.replace(cfg), path)
    path.write_text(path.read_text().replace("top_k: 2", "top_k: 99"))
    with pytest.raises(ConfigError, match="model.moe.top_k"):
        load_config(path)
