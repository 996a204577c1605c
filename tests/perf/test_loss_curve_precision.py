"""benchmarks/loss_curve.py --compare precision: the CPU smoke run (the fp8 slot stands in with bf16), the verdict
rule on made-up curves, and the premise of the noise yardstick: a model handed to the Trainer from another init seed
changes the init only (handed the same seed's model, the run is bitwise the Trainer's own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import util
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        mod = util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_precision_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "benchmarks/loss_curve.py", "--smoke", "--compare", "precision",
                           "--out", str(tmp_path / "out"), "--data-cache", str(tmp_path / "cache")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "loss_curve_precision.json").read_text())
    curves, summary, meta = result["curves"], result["summary"], result["meta"]
    assert set(curves) == {"bf16", "bf16_b", "fp8"} and all(len(c) == 8 for c in curves.values())
    assert meta["plan"]["fp8"]["precision"].startswith("bf16 (stand-in") and meta["plan"]["bf16_b"]["init_seed"] != \
        meta["plan"]["bf16"]["init_seed"] == meta["data_seed"]
    assert curves["fp8"] == curves["bf16"]  # the stand-in is the same run
    assert curves["bf16_b"][0] != curves["bf16"][0]  # another init
    assert summary["noise_mean_abs_bf16_b_vs_bf16"] > 0 and summary["gap_mean_abs_fp8_vs_bf16"] == 0
    assert "within_bf16_noise" not in summary and "no verdict" in summary["verdict"]
    assert proc.stdout.rstrip().endswith(summary["verdict"])


def test_verdict_rule():
    pm = _load("loss_curve_precision")
    bf16 = [5.0 - 0.01 * i for i in range(300)]
    bf16_b = [x + (0.02 if i % 2 else -0.02) for i, x in enumerate(bf16)]  # noise 0.02, no offset
    rates = {"bf16": 100.0, "bf16_b": 100.0, "fp8": 120.0}
    s = pm.summarize({"bf16": bf16, "bf16_b": bf16_b, "fp8": [x + 0.015 for x in bf16]}, rates, 100, 10, True)
    assert s["window"] == 100 and abs(s["noise_mean_abs_bf16_b_vs_bf16"] - 0.02) < 1e-9
    assert abs(s["gap_signed_mean_fp8_minus_bf16"] - 0.015) < 1e-9
    assert abs(s["noise_signed_mean_bf16_b_minus_bf16"]) < 1e-9
    assert abs(s["smoothed_gap_mean_abs"] - 0.015) < 1e-9 and s["smoothed_noise_mean_abs"] < 1e-9
    assert s["within_bf16_noise"] and s["verdict"].endswith("yes") and abs(s["fp8_speed_vs_bf16"] - 1.2) < 1e-9
    far = [x + 0.025 for x in bf16]
    far[10] += 1.0  # outside the window: only the all-steps max sees it
    s = pm.summarize({"bf16": bf16, "bf16_b": bf16_b, "fp8": far}, rates, 100, 10, True)
    assert not s["within_bf16_noise"] and s["verdict"].endswith("no")
    assert abs(s["gap_max_abs_fp8_vs_bf16"] - 0.025) < 1e-9
    assert abs(s["max_abs_all_steps"]["fp8_vs_bf16"] - 1.025) < 1e-9
    assert pm.table(s).splitlines()[-1] == s["verdict"]


def test_handed_model_changes_the_init_only(tmp_path):
    from moe_launch.rundir import RunDir, read_jsonl
    from moe_launch.trainer.loop import Trainer
    from moe_launch.trainer.standby import warm_model

    lc = _load("loss_curve")
    cfg = lc.root_config(True, 3, "reference", "fp32", False, str(tmp_path / "cache"))

    def losses(name: str, init_seed: int | None) -> list[float]:
        model = None
        if init_seed is not None:
            seeded = lc.dataclasses.replace(cfg, train=lc.dataclasses.replace(cfg.train, seed=init_seed))
            model = warm_model(seeded, torch.device("cpu"))
        trainer = Trainer(cfg, RunDir(tmp_path / name), model=model)
        assert trainer.train() == 0
        return [r["lm_loss"] for r in sorted(read_jsonl(RunDir(tmp_path / name).metrics), key=lambda r: r["step"])]

    own = losses("own", None)
    assert losses("handed_same_seed", cfg.train.seed) == own
    assert losses("handed_other_seed", cfg.train.seed + 1)[0] != own[0]
