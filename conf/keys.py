"""Keys the typed config does not have. Hydra's `+key=value` adds a key even to a structured config, and converting
to the dataclasses then drops it without a word: `+train.unknown_key=1` would run as if never typed."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf


def unknown_keys(node: Any, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(dotted key, the known keys beside it) for every key of `node` that its dataclass lacks, depth first."""
    if not isinstance(node, DictConfig):
        return []
    schema = OmegaConf.get_type(node)
    if not (schema and dataclasses.is_dataclass(schema)):
        return []  # a plain dict field (health.inject_delay): any key is allowed
    known = [f.name for f in dataclasses.fields(schema)]
    found: list[tuple[str, list[str]]] = []
    for key in node.keys():
        dotted = f"{prefix}{key}"
        if key not in known:
            found.append((dotted, known))
        else:
            found += unknown_keys(node._get_node(key), dotted + ".")
    return found
