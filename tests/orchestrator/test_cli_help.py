"""What a new user types first: `--help` at every level, a mistyped run directory or key, several bad values at once,
and no empty moe-launch.log left in run directories. Each call runs the real console script."""

from __future__ import annotations

import subprocess

import pytest
from e2e_util import MOE_LAUNCH

from moe_launch.orchestrator.commands import SUBCOMMANDS


def cli(tmp_path, *args, timeout=60):
    return subprocess.run([MOE_LAUNCH, *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def test_top_level_help_lists_subcommands_other_clis_and_config_groups(tmp_path):
    proc = cli(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    for word in (*SUBCOMMANDS, "moe-health", "moe-data", "--dry-run", "exit codes"):
        assert word in proc.stdout, word
    assert "cluster: local, slurm" in proc.stdout  # Hydra's config groups follow ours
    assert cli(tmp_path, "-h").stdout == proc.stdout


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_help_exits_0(tmp_path, sub):
    proc = cli(tmp_path, sub, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: moe-launch {sub}"), proc.stdout + proc.stderr


@pytest.mark.parametrize("sub", ["report", "export", "status"])
def test_missing_run_is_named(tmp_path, sub):
    extra = ["--hf", str(tmp_path / "hf")] if sub == "export" else []
    proc = cli(tmp_path, sub, "runs/nope", *extra)
    assert proc.returncode == 2 and "runs/nope" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_usage_error_is_a_bad_input_exit(tmp_path):
    proc = cli(tmp_path, "export", "runs/x")  # --hf missing
    assert proc.returncode == 2 and "--hf" in proc.stderr


def test_hydra_override_errors_exit_with_the_bad_config_code(tmp_path):
    for override in ("train.lrr=3", "train.steps=many", "model=nosuch"):
        proc = cli(tmp_path, "--dry-run", override)
        assert proc.returncode == 2, (override, proc.returncode, proc.stderr)


def test_every_bad_value_is_reported_at_once(tmp_path):
    proc = cli(tmp_path, "--dry-run", "train.lr=-1", "train.steps=0", "model.moe.top_k=99", "cluster.nodes=0")
    assert proc.returncode == 2
    for key in ("train.lr", "train.steps", "model.moe.top_k", "cluster.nodes"):
        assert f"  {key}:" in proc.stderr, (key, proc.stderr)


def test_job_logging_writes_no_log_file(tmp_path):
    proc = cli(tmp_path, "--cfg", "hydra")
    assert proc.returncode == 0 and "FileHandler" not in proc.stdout and "moe-launch.log" not in proc.stdout
