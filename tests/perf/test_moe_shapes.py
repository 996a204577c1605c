"""Smoke run of benchmarks/moe_shapes.py (the expert layer at common shapes vs the naive pipeline): tiny fp32 shapes on
CPU, Triton under the interpreter, no FP8; every shape checks ours against the naive pipeline and is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import astuple
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_moe_shapes_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "benchmarks/moe_shapes.py", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import moe_shapes
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    common = {astuple(s.dims) for s in moe_shapes.shapes(False)}
    models = moe_shapes.shapes(False, "models")
    assert models == moe_shapes.model_shapes() and len(models) == 7
    assert not {astuple(s.dims) for s in models} & common
    assert moe_shapes.shapes(True, "models") == moe_shapes.shapes(True)  # the smoke run's tiny shapes either way
