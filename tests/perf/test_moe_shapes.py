"""Smoke run of benchmarks/moe_shapes.py (the expert layer at common shapes vs the naive pipeline): tiny fp32 shapes on
CPU, Triton under the interpreter, no FP8; every shape checks ours against the naive pipeline and is timed."""

from __future__ import annotations

import json
import sys
from dataclasses import astuple
from pathlib import Path

from bench_smoke import run_smoke

REPO = Path(__file__).resolve().parents[2]


def test_moe_shapes_smoke(tmp_path):
    proc = run_smoke("moe_shapes.py", "--out", str(tmp_path))
    shapes = json.loads((tmp_path / "moe_shapes.json").read_text())["shapes"]
    assert len(shapes) == 8
    for name, res in shapes.items():
        ours = {"ours bf16", "ours bf16, grads into .grad", "ours bf16, grads into .grad, CUDA graph"}
        assert set(res["rows"]) == ours | {"naive bf16", "naive bf16, grads added to .grad"}, name
        assert all(res["rows"][row]["ok"] for row in ours), (name, res["rows"])
        assert all(row["ms"] > 0 for row in res["rows"].values()), name
    skewed = next(res for name, res in shapes.items() if name.startswith("skewed"))
    assert skewed["load"]["hot_share"] > 0.5
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| few tokens: T 1024")  # the table prints last


def test_model_shapes_are_not_the_common_ones():
    """--set models: published models' shapes the layer was not worked on; none repeats a common shape."""
    moe_shapes = _moe_shapes_module()
    common = {astuple(s.dims) for s in moe_shapes.shapes(False)}
    models = moe_shapes.shapes(False, "models")
    assert models == moe_shapes.model_shapes() and len(models) == 7
    assert not {astuple(s.dims) for s in models} & common
    assert moe_shapes.shapes(True, "models") == moe_shapes.shapes(True)  # the smoke run's tiny shapes either way


def _moe_shapes_module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import moe_shapes
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return moe_shapes


def test_parse_shape():
    moe_shapes = _moe_shapes_module()
    shape = moe_shapes.parse_shape("8192, 4096,1536,32,8")
    assert astuple(shape.dims) == (8192, 4096, 1536, 32, 8)
    assert shape.name == "T 8192, D 4096, F 1536, 32 experts, top-8" and shape.hot == 0
    for bad in ("8192,4096,1536,32", "8192,4096,1536,32,8,1", "8192,4096,0,32,8", "8192,4096,1536,4,8", "a,b,c,d,e"):
        try:
            moe_shapes.parse_shape(bad)
        except ValueError as e:
            assert "--shape" in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_given_shapes_run_instead_of_a_set(tmp_path):
    """--shape runs exactly the shapes given (checked against the naive pipeline, then timed); a malformed one stops
    the script before anything runs, naming the option."""
    args = ["--out", str(tmp_path), "--rows", "bf16", "--rep-ms", "20"]
    run_smoke("moe_shapes.py", *args, "--shape", "40,32,24,6,3", "--shape", "24,32,16,4,1")
    shapes = json.loads((tmp_path / "moe_shapes-given.json").read_text())["shapes"]
    assert [r["dims"] for r in shapes.values()] == [dict(T=40, D=32, F=24, E=6, K=3), dict(T=24, D=32, F=16, E=4, K=1)]
    for res in shapes.values():
        assert res["rows"]["ours bf16"]["ok"] and res["rows"]["ours bf16"]["ms"] > 0
    log = (tmp_path / "moe_shapes-given.log").read_text()
    bad = run_smoke("moe_shapes.py", *args, "--shape", "40,32,24,6", timeout=120, check=False)
    assert bad.returncode == 2 and "--shape takes five positive integers" in bad.stderr
    assert (tmp_path / "moe_shapes-given.log").read_text() == log  # refused before its log was opened
