"""Smoke run of benchmarks/row_pitch.py on CPU: the fused SwiGLU GEMMs and the weight-gradient GEMM under Triton's
interpreter on contiguous and line-aligned rows, which the script checks give the same values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_row_pitch_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "benchmarks/row_pitch.py", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out,) = tmp_path.glob("row_pitch-*.json")
    same = json.loads(out.read_text())["results"]["tiny"]["same"]
    assert same == {"swiglu_up": True, "dual_mm": True}, same
