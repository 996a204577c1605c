"""Refused before anything is written: a run.name that is not one directory name (Hydra would create it first), and
keys the typed config does not have (`+train.unknown_key=1` would otherwise be dropped without a word)."""

from __future__ import annotations

import subprocess

import pytest
from e2e_util import MOE_LAUNCH
from hydra import compose, initialize

from moe_launch.conf.keys import unknown_keys
from moe_launch.conf.store import register


def cli(tmp_path, *args):
    return subprocess.run([MOE_LAUNCH, "--dry-run", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [["run.name=a/b"], ["run.name=.."], ["-m", "run.name=ok,x/y"]])
def test_bad_run_name_leaves_no_directory(tmp_path, args):
    (tmp_path / "work").mkdir()
    proc = cli(tmp_path / "work", *args)
    assert proc.returncode == 2 and "run.name" in proc.stderr and "Fix:" in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.rglob("*")] == ["work"]  # nothing created, not even .hydra in the parent


@pytest.mark.parametrize("override,key", [("+train.unknown_key=1", "train.unknown_key"),
                                          ("++model.moe.zzz=2", "model.moe.zzz")])
def test_unknown_added_key_is_refused(tmp_path, override, key):
    proc = cli(tmp_path, "run.name=u", override)
    assert proc.returncode == 2 and f"{key}: not a setting of moe-launch" in proc.stderr, proc.stderr
    assert "seq_len" in proc.stderr or "num_experts" in proc.stderr  # the keys that do exist are listed
    ok = cli(tmp_path, "run.name=u", "++health.inject_delay={node2: 0.5}")  # a dict field takes any key
    assert ok.returncode == 0, ok.stderr


def test_unknown_keys_walks_the_structured_config():
    register()
    with initialize(version_base=None, config_path=None):
        cfg = compose("moe_launch", overrides=["+train.fault_injection.kindd=nan", "++health.inject_delay={a: 1}"])
    assert [k for k, _ in unknown_keys(cfg)] == ["train.fault_injection.kindd"]
