"""`all_problems()`: a config with several bad values names every one of them in one error."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from moe_launch.conf.schema import ConfigProblems, RootConfig, TrainConfig, all_problems
from moe_launch.errors import ConfigError


def _node(**train):
    return OmegaConf.merge(OmegaConf.structured(RootConfig), {"train": train})


def test_several_problems_in_one_error():
    with pytest.raises(ConfigProblems) as info:
        with all_problems():
            OmegaConf.to_object(_node(lr=-1.0, steps=0, schedule="linear"))
    keys = [p.key for p in info.value.problems]
    assert {"train.lr", "train.steps", "train.schedule"} <= set(keys)
    assert isinstance(info.value, ConfigError) and str(info.value).startswith(f"{len(keys)} problems:")


def test_one_problem_is_a_plain_config_error_and_outside_the_block_the_first_raises():
    with pytest.raises(ConfigError) as info:
        with all_problems():
            OmegaConf.to_object(_node(steps=0))
    assert not isinstance(info.value, ConfigProblems) and info.value.key == "train.steps"
    with pytest.raises(ConfigError, match="train.steps"):
        TrainConfig(steps=0, lr=-1.0)


def test_a_good_config_passes():
    with all_problems():
        cfg = OmegaConf.to_object(_node())
    assert cfg.train.steps >= 1
