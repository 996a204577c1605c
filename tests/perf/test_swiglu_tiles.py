"""Smoke run of benchmarks/swiglu_tiles.py on CPU: the SwiGLU kernels on two tiles under Triton's interpreter, checked
by the script itself against the default tile."""

from __future__ import annotations

import json

from bench_smoke import run_smoke


def test_swiglu_tiles_smoke(tmp_path):
    run_smoke("swiglu_tiles.py", "--out", str(tmp_path))
    (out,) = tmp_path.glob("swiglu_tiles-*.json")
    rows = json.loads(out.read_text())["results"]["tiny"]["rows"]
    assert [(r["kernel"], r["default"]) for r in rows] == [("fwd", True), ("fwd", False), ("bwd", True),
                                                            ("bwd", False)]
    assert all(r["diff"] == 0.0 for r in rows), rows
