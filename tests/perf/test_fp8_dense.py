"""Smoke run of benchmarks/fp8_dense.py (would FP8 pay for the dense linears?): tiny shapes on CPU, the quantization
under Triton's interpreter, the FP8 GEMM emulated in fp32; every GEMM is timed and the FP8 output is checked against
bf16."""

from __future__ import annotations

import json
import math

from bench_smoke import run_smoke


def test_fp8_dense_smoke(tmp_path):
    proc = run_smoke("fp8_dense.py", "--rep-ms", "5", "--out", str(tmp_path))
    result = json.loads((tmp_path / "fp8_dense.json").read_text())
    assert result["env"]["fp8_emulated"] is True
    assert [r["linear"]["name"] for r in result["rows"]] == ["attention projection (q, k, v, o)", "output head"]
    for row in result["rows"]:
        assert all(ms > 0 for ms in row["ms"].values()), row
        assert row["rel_err_y"] < 0.1, row  # e4m3 with row and column scales: a few percent, as the experts
        assert math.isclose(row["saved_ms_per_micro_batch"], row["saved_ms_per_call"] * row["linear"]["per_step"])
    assert proc.stdout.rstrip().splitlines()[-1].startswith("FP8 for every dense linear")
