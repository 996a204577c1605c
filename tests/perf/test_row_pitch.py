"""Smoke run of benchmarks/row_pitch.py on CPU: the fused SwiGLU GEMMs and the weight-gradient GEMM under Triton's
interpreter on contiguous and line-aligned rows, which the script checks give the same values."""

from __future__ import annotations

import json

from bench_smoke import run_smoke


def test_row_pitch_smoke(tmp_path):
    run_smoke("row_pitch.py", "--out", str(tmp_path))
    (out,) = tmp_path.glob("row_pitch-*.json")
    same = json.loads(out.read_text())["results"]["tiny"]["same"]
    assert same == {"swiglu_up": True, "dual_mm": True}, same
