"""Smoke run of benchmarks/wgrad_accumulate.py on CPU: the accumulating weight-gradient kernel under Triton's
interpreter, checked by the script itself against old + the reference product."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wgrad_accumulate_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "benchmarks/wgrad_accumulate.py", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out,) = tmp_path.glob("wgrad_accumulate-*.json")
    rows = json.loads(out.read_text())["results"]["tiny"]
    assert [r["gemm"] for r in rows] == ["gate/up: dg^T x", "down: dy^T h"]
    assert all(0 <= r["err"]["cpu"] <= 1e-6 for r in rows), rows
