"""Learning-rate schedules and clipping policy (pure functions)."""

from dataclasses import replace

import pytest

from moe_launch.conf.schema import TrainConfig
from moe_launch.trainer.optim import clip_norm_at, lr_at

OPTIMUS = TrainConfig(steps=10_000, lr=4e-4, min_lr=4e-5, warmup_steps=2500)


def test_warmup_then_cosine_to_min_lr():
    assert lr_at(0, OPTIMUS) == pytest.approx(4e-4 / 2500)
    assert lr_at(1249, OPTIMUS) == pytest.approx(2e-4)
    assert lr_at(2499, OPTIMUS) == pytest.approx(4e-4)
    assert lr_at(2500, OPTIMUS) == pytest.approx(4e-4)
    mid = 2500 + (9999 - 2500) / 2
    assert lr_at(int(mid), OPTIMUS) == pytest.approx((4e-4 + 4e-5) / 2, rel=1e-3)
    assert lr_at(9999, OPTIMUS) == pytest.approx(4e-5)
    lrs = [lr_at(s, OPTIMUS) for s in range(2500, 10_000)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_wsd_stable_then_linear_decay():
    cfg = replace(OPTIMUS, schedule="wsd", wsd_decay_fraction=0.2)
    assert lr_at(7999, cfg) == pytest.approx(4e-4)
    assert lr_at(8000, cfg) == pytest.approx(4e-4)
    assert lr_at(9999, cfg) == pytest.approx(4e-5)
    assert lr_at(9000, cfg) == pytest.approx(4e-4 + (4e-5 - 4e-4) * 1000 / 1999)


def test_constant_and_no_warmup():
    cfg = replace(OPTIMUS, schedule="constant", warmup_steps=0)
    assert lr_at(0, cfg) == lr_at(9999, cfg) == 4e-4


def test_clip_only_after_warmup():
    assert clip_norm_at(0, OPTIMUS) == 1.0
    cfg = replace(OPTIMUS, clip_after_warmup_only=True)
    assert clip_norm_at(2499, cfg) == 0.0 and clip_norm_at(2500, cfg) == 1.0
