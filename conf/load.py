"""Load a resolved config file into typed dataclasses without Hydra (used by the trainer and the supervisor)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from moe_launch.conf.schema import RootConfig


def load_config(path: str | Path) -> RootConfig:
    raw = OmegaConf.load(path)
    raw.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(RootConfig), raw)
    return OmegaConf.to_object(merged)


def dump_config(cfg: RootConfig, path: str | Path) -> None:
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
