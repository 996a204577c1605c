"""Smoke run of benchmarks/norm_rope.py on CPU: the fused QK-norm + RoPE kernel under Triton's interpreter against the
model's modules (eager here), and the attention sublayer with both settings of model.qk_norm_rope_fusion."""

from __future__ import annotations

import json

from bench_smoke import run_smoke


def test_norm_rope_bench_smoke(tmp_path):
    run_smoke("norm_rope.py", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "norm_rope.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["norm+rope compiled modules", "norm+rope fused kernel",
                                         "attention sublayer, fusion off", "attention sublayer, fusion on"]
    assert all(r["ms"] > 0 for r in rows)
    assert max(rows[1]["rel err vs modules"].values()) < 1e-5, rows[1]
