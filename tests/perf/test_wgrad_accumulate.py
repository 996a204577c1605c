"""Smoke run of benchmarks/wgrad_accumulate.py on CPU: the accumulating weight-gradient kernel under Triton's
interpreter, checked by the script itself against old + the reference product."""

from __future__ import annotations

import json

from bench_smoke import run_smoke


def test_wgrad_accumulate_smoke(tmp_path):
    run_smoke("wgrad_accumulate.py", "--out", str(tmp_path))
    (out,) = tmp_path.glob("wgrad_accumulate-*.json")
    rows = json.loads(out.read_text())["results"]["tiny"]
    assert [r["gemm"] for r in rows] == ["gate/up: dg^T x", "down: dy^T h"]
    assert all(0 <= r["err"]["cpu"] <= 1e-6 for r in rows), rows
