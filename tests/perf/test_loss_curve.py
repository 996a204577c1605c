"""Smoke run of benchmarks/loss_curve.py (the 200-step loss-curve comparison): the real Trainer three times
(fast Triton MoE path under the interpreter, reference path twice), all fp32 on CPU for 5 steps; the script writes
its JSON with three full curves and the summary, and the curves agree (same data, same init)."""

from __future__ import annotations

import json
from pathlib import Path

from bench_smoke import run_smoke

REPO = Path(__file__).resolve().parents[2]


def test_loss_curve_smoke(tmp_path):
    proc = run_smoke("loss_curve.py", "--out", str(tmp_path / "out"), "--data-cache", str(tmp_path / "cache"),
                     interpret=False)
    result = json.loads((tmp_path / "out" / "loss_curve.json").read_text())
    curves, summary = result["curves"], result["summary"]
    assert set(curves) == {"fast", "ref_bf16", "ref_fp32"}
    assert all(len(c) == 5 for c in curves.values())
    # ln(512) = 6.24 at init; every run starts there and its loss moves
    assert all(abs(c[0] - 6.24) < 0.3 and c[-1] != c[0] for c in curves.values())
    # in fp32 the Triton path and the reference compute the same function: only rounding may separate them
    assert summary["max_abs_fast_vs_ref_bf16"] < 1e-4
    assert summary["max_abs_ref_bf16_vs_ref_fp32"] < 1e-4
    assert summary["final"]["fast"] == curves["fast"][-1]
    assert all("error" not in r and r["seconds"] > 0 for r in result["meta"]["runs"].values())
    assert "within_bf16_noise" not in summary and "no verdict" in summary["verdict"]
    assert summary["verdict"] in proc.stdout


def test_summary_verdict():
    from importlib import util

    spec = util.spec_from_file_location("loss_curve", REPO / "benchmarks" / "loss_curve.py")
    lc = util.module_from_spec(spec)
    spec.loader.exec_module(lc)
    ref32 = [5.0 - 0.01 * i for i in range(200)]
    ref = [x + (0.02 if i % 2 else -0.02) for i, x in enumerate(ref32)]  # bf16 noise 0.02
    close = [x + 0.03 for x in ref]  # 0.03 <= 2 * 0.02 + 0.01
    far = [x + 0.06 for x in ref]
    s = lc.summarize({"fast": close, "ref_bf16": ref, "ref_fp32": ref32}, window=100, verdict=True)
    assert s["window"] == 100 and abs(s["mean_abs_ref_bf16_vs_ref_fp32"] - 0.02) < 1e-9
    assert s["within_bf16_noise"] and s["verdict"].endswith("yes")
    s = lc.summarize({"fast": far, "ref_bf16": ref, "ref_fp32": ref32}, window=100, verdict=True)
    assert not s["within_bf16_noise"] and s["verdict"].endswith("no")
    far[50] += 1.0  # outside the window: counts for the max, not for the mean
    s = lc.summarize({"fast": far, "ref_bf16": ref, "ref_fp32": ref32}, window=100, verdict=True)
    assert abs(s["max_abs_fast_vs_ref_bf16"] - 1.06) < 1e-9 and not s["within_bf16_noise"]
