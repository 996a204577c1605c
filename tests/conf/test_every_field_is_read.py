"""Every config field is read by code that runs: a knob that changes nothing is a bug (the user sets it and trusts it).

Walks the dataclasses of conf/schema.py from RootConfig and looks for an attribute read `.<field>` in the modules the
product actually loads: the import closure (static, from the source) of the console scripts in pyproject.toml and of
every module started as `python -m moe_launch....`. Code nothing imports does not count as a reader (a tracker class
the trainer never used once "read" two knobs that changed nothing). The schema and the presets only declare and
validate, so they do not count either.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

from moe_launch.conf.schema import RootConfig

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "trainer", "kernels", "health", "conf")
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


def module_file(name: str) -> Path | None:
    """moe_launch.a.b -> a/b.py or a/b/__init__.py (moe_launch.<pkg> maps to the top-level folder <pkg>)."""
    parts = name.split(".")[1:]
    if not parts:
        return REPO / "moe_launch" / "__init__.py"
    base = REPO.joinpath(*parts) if parts[0] in PACKAGES else REPO / "moe_launch" / Path(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts if parts[0] == "moe_launch" else ["moe_launch", *parts])


def _imports(path: Path) -> set[str]:
    """moe_launch modules a file imports (also inside functions: lazy imports run too; relative ones resolved)."""
    names = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            node = ast.ImportFrom(module=f"{base}.{node.module}" if node.module else base, names=node.names, level=0)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe_launch"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("moe_launch"))
    return names


def entry_modules() -> set[str]:
    """Console scripts, modules the product starts as `python -m moe_launch....`, and runnable packages."""
    scripts = (REPO / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    entries = set(re.findall(r"=\s*\"(moe_launch[\w.]*):", scripts))
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            entries.update(re.findall(r"[\"'](moe_launch(?:\.\w+)+)[\"']", path.read_text()))
            if path.name == "__main__.py":
                entries.add(module_name(path.parent / "__init__.py"))
    return entries


def reachable_files() -> set[Path]:
    todo = list(entry_modules())
    seen: set[Path] = set()
    while todo:
        name = todo.pop()
        for i in range(2, name.count(".") + 2):  # importing a.b.c runs a/__init__ and a/b/__init__ too
            prefix = ".".join(name.split(".")[:i])
            path = module_file(prefix)
            if path is None or path in seen:
                continue
            seen.add(path)
            todo.extend(_imports(path))
            if path.name == "__init__.py":
                if (path.parent / "__main__.py").is_file():
                    todo.append(prefix + ".__main__")
                if "import_module(" in path.read_text():  # lazy exports (PEP 562): any submodule may load
                    todo.extend(f"{prefix}.{p.stem}" for p in path.parent.glob("*.py"))
    return seen


def test_walk_sees_nested_groups_and_the_closure_starts_at_the_entry_points():
    keys = {k for k, _ in walk(RootConfig)}
    assert {"train.lr", "model.moe.top_k", "health.alltoall.iters", "train.fault_injection.kind"} <= keys
    files = reachable_files()
    for rel in ("orchestrator/cli.py", "trainer/loop.py", "health/node_check.py", "trainer/data/prepare.py",
                "trainer/tracking/tracker.py", "trainer/data/loader.py", "trainer/interop/upcycle.py"):
        assert REPO / rel in files, rel


def test_every_config_field_has_a_reader():
    code = "\n".join(p.read_text() for p in reachable_files() - DECLARING)
    unread = [key for key, name in walk(RootConfig) if not re.search(rf"\.{name}\b", code)]
    assert not unread, f"config fields no running code reads (wire them or delete them): {unread}"
