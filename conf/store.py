"""Registers the typed configs and their presets in Hydra's ConfigStore. The only Hydra-aware module of conf/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from moe_launch.conf import presets
from moe_launch.conf.schema import RootConfig, RunConfig

DEFAULTS = [
    "_self_",
    {"model": "tiny_moe"},
    {"cluster": "local"},
    {"parallel": "default"},
    {"train": "default"},
    {"data": "builtin"},
    {"health": "default"},
]


@dataclass
class AppConfig(RootConfig):
    defaults: list[Any] = field(default_factory=lambda: list(DEFAULTS))
    run: RunConfig = field(default_factory=lambda: RunConfig(name="${now:%Y-%m-%d_%H-%M-%S}"))


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="moe_launch", node=AppConfig)
    for group, table in (
        ("model", presets.MODELS),
        ("cluster", presets.CLUSTERS),
        ("parallel", presets.PARALLEL),
        ("train", presets.TRAIN),
        ("data", presets.DATA),
        ("health", presets.HEALTH),
    ):
        for name, node in table.items():
            cs.store(group=group, name=name, node=node)
