"""Every config field is read by some code: a knob that changes nothing is a bug (the user sets it and trusts it).

Walks the dataclasses of conf/schema.py from RootConfig and looks for an attribute read `.<field>` (or a string key
"<field>" for fields read through getattr / asdict) in the package's code outside the schema and the presets, which
only declare and validate.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from moe_launch.conf.schema import RootConfig

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "trainer", "kernels", "health", "conf", "moe_launch")
DECLARING = {REPO / "conf" / "schema.py", REPO / "conf" / "presets.py"}


def walk(cls: type, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, field name) of every leaf and group of a config dataclass."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.append((key, f.name))
        inner = hints[f.name]
        for arg in typing.get_args(inner) or (inner,):
            if dataclasses.is_dataclass(arg):
                out += walk(arg, key + ".")
    return out


def _sources() -> str:
    texts = []
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            if path not in DECLARING:
                texts.append(path.read_text())
    return "\n".join(texts)


def test_walk_sees_nested_groups():
    keys = {k for k, _ in walk(RootConfig)}
    assert {"train.lr", "model.moe.top_k", "health.alltoall.iters", "train.fault_injection.kind"} <= keys


def test_every_config_field_has_a_reader():
    code = _sources()
    unread = [key for key, name in walk(RootConfig)
              if not re.search(rf"\.{name}\b|[\"']{name}[\"']", code)]
    assert not unread, f"config fields no code reads (wire them or delete them): {unread}"
