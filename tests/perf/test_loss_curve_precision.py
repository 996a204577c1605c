"""benchmarks/loss_curve.py --compare precision: the CPU smoke run (the fp8 slot stands in with bf16), the verdict
rule on made-up curves, and the premise of the noise yardstick: a model handed to the Trainer from another init seed
changes the init only (handed the same seed's model, the run is bitwise the Trainer's own)."""

from __future__ import annotations

import json
import sys
from importlib import util
from pathlib import Path

import torch
from bench_smoke import run_smoke

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
    proc = run_smoke("loss_curve.py", "--compare", "precision", "--out", str(tmp_path / "out"), "--data-cache",
                     str(tmp_path / "cache"), interpret=False, timeout=600)
    result = json.loads((tmp_path / "out" / "loss_curve_precision.json").read_text())
    curves, summary, meta = result["curves"], result["summary"], result["meta"]
    assert set(curves) == {"bf16", "bf16_b", "fp8"} and all(len(c) == 8 for c in curves.values())
    assert meta["plan"]["fp8"]["setting"].startswith("bf16 (stand-in") and meta["plan"]["bf16_b"]["init_seed"] != \
        meta["plan"]["bf16"]["init_seed"] == meta["data_seed"]
    assert curves["fp8"] == curves["bf16"]  # the stand-in is the same run
    assert curves["bf16_b"][0] != curves["bf16"][0]  # another init
    assert summary["noise_mean_abs_bf16_b_vs_bf16"] > 0 and summary["gap_mean_abs_fp8_vs_bf16"] == 0
    assert "within_bf16_noise" not in summary and "no verdict" in summary["verdict"]
    assert proc.stdout.rstrip().endswith(summary["verdict"])
    # the held-out sequences: never trained on, each final model's loss on them reported
    held = summary["heldout_lm_loss"]
    assert meta["heldout_sequences"] == 8 and set(held) == {"bf16", "bf16_b", "fp8"}
    assert held["fp8"] == held["bf16"] != held["bf16_b"] and summary["heldout_gap_fp8_minus_bf16"] == 0
    assert all(meta["runs"][n]["heldout_lm_loss"] == held[n] for n in held)
    assert [step for step, _ in meta["runs"]["bf16"]["heldout"]] == [4, 8]  # the trainer's evaluations
    assert "heldout_within_bf16_noise" not in summary and "held-out loss: bf16" in proc.stdout


def test_router_smoke(tmp_path):
    """--compare router: the variant run has model.moe.router_gemm=fp32; on the CPU (fp32 parameters) every run's
    router takes the fp32 GEMMs, so the variant's curve is bf16's."""
    proc = run_smoke("loss_curve.py", "--compare", "router", "--steps", "4", "--holdout", "0", "--out",
                     str(tmp_path / "out"), "--data-cache", str(tmp_path / "cache"), interpret=False, timeout=600)
    result = json.loads((tmp_path / "out" / "loss_curve_router.json").read_text())
    curves, summary, meta = result["curves"], result["summary"], result["meta"]
    assert set(curves) == {"bf16", "bf16_b", "router_fp32"} and meta["compare"] == "router"
    assert meta["plan"]["router_fp32"]["router_gemm"] == "fp32" and meta["plan"]["bf16"]["router_gemm"] == "bf16"
    assert curves["router_fp32"] == curves["bf16"] and summary["gap_mean_abs_router_fp32_vs_bf16"] == 0
    assert summary["variant"] == "router_fp32" and "router_fp32 - bf16" in proc.stdout


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
    s = pm.summarize({"bf16": bf16, "bf16_b": bf16_b, "fp8": far}, rates, 100, 10, True,
                     heldout={"bf16": 3.0, "bf16_b": 3.02, "fp8": 2.99})
    assert abs(s["heldout_gap_fp8_minus_bf16"] + 0.01) < 1e-9
    assert abs(s["heldout_noise_bf16_b_minus_bf16"] - 0.02) < 1e-9
    assert s["heldout_within_bf16_noise"] and "within: yes" in pm.table(s)
    s = pm.summarize({"bf16": bf16, "bf16_b": bf16_b, "fp8": far}, rates, 100, 10, True,
                     heldout={"bf16": 3.0, "bf16_b": 3.01, "fp8": 2.97})
    assert not s["heldout_within_bf16_noise"] and "within: no" in pm.table(s)


def test_split_heldout_trains_on_the_rest_only(tmp_path):
    import numpy as np

    from moe_launch.trainer.data import shards

    lc = _load("loss_curve")
    src = tmp_path / "src"
    src.mkdir()
    rows_NL = np.arange(50 * 9, dtype=np.uint16).reshape(50, 9)  # every row distinct
    for i, part in enumerate((rows_NL[:30], rows_NL[30:])):  # two shards: the split reads across them
        shards.write_shard(src, i, part)
    shards.write_index(src, shards.ShardIndex(
        seq_len=8, dtype="uint16", vocab_size=512, eos_id=0, max_token_id=int(rows_NL.max()),
        shards=[{"file": shards.shard_name(0), "count": 30}, {"file": shards.shard_name(1), "count": 20}],
        tokenizer="test", seed=0, shard_size=30, total_tokens=int(rows_NL.size)))
    train_dir, held_dir = lc.split_heldout(src, tmp_path / "out", 7)

    def rows(d):
        return np.concatenate([np.asarray(s) for s in shards.open_shards(d, shards.read_index(d))])

    assert np.array_equal(rows(train_dir), rows_NL[:43]) and np.array_equal(rows(held_dir), rows_NL[43:])
    assert shards.read_index(src).total_instances == 50  # the prepared dataset is left as it was
    cfg = lc.with_heldout(lc.root_config(True, 8, "fast", "fp32", False, str(tmp_path)), train_dir, held_dir, 8, 4)
    assert (cfg.data.path, cfg.data.eval_path) == (str(train_dir), str(held_dir))
    assert (cfg.train.eval_interval, cfg.train.eval_batches) == (4, 2)  # 8 sequences = 2 global batches of 4


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


def test_plan_follows_the_seed():
    """--seed A: every run trains on the order of A; bf16 and fp8 start from A's init, bf16_b from A + 1."""
    from moe_launch.conf.schema import RootConfig

    pm = _load("loss_curve_precision")
    for seed_a in (pm.SEED_A, 2024):
        runs = pm.plan(False, lambda precision: RootConfig(), seed_a)
        assert [r.name for r in runs] == ["bf16", "bf16_b", "fp8"]
        assert {r.cfg.train.seed for r in runs} == {seed_a}
        assert [r.init_seed for r in runs] == [seed_a, seed_a + 1, seed_a]
        assert [r.label for r in runs] == ["bf16", "bf16", "fp8"]
    runs = pm.plan(False, lambda setting: RootConfig(), pm.SEED_A, variant="router_fp32")
    assert [(r.name, r.label) for r in runs] == [("bf16", "bf16"), ("bf16_b", "bf16"), ("router_fp32", "router_fp32")]
