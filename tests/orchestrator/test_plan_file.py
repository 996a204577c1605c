"""The plan is written once per allocation (runs/<name>/plan.json) and the supervisor runs what it says: its nodes and
its trainer command, not a second derivation from the config."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from e2e_util import MOE_LAUNCH

from moe_launch.conf.load import dump_config
from moe_launch.conf.schema import (
    ClusterConfig,
    HealthConfig,
    ParallelConfig,
    RootConfig,
    RunConfig,
    SupervisorConfig,
    TrainConfig,
)
from moe_launch.errors import SubmissionError
from moe_launch.orchestrator.plan import plan, read_plan, write_plan
from moe_launch.orchestrator.supervisor import Supervisor
from moe_launch.rundir import RunDir

FAKE = str(Path(__file__).parent / "fake_trainer.py")


def test_plan_round_trips_through_its_file(tmp_path):
    p = plan(RootConfig(cluster=ClusterConfig(kind="local", nodes=2, buffers=1), parallel=ParallelConfig(dp=2)),
             run_dir=str(tmp_path))
    write_plan(p, tmp_path)
    assert read_plan(tmp_path) == p and read_plan(tmp_path).local_nodes == ("local1", "local2", "local3")
    with pytest.raises(SubmissionError, match="plan.json cannot be read"):
        read_plan(tmp_path / "elsewhere")


def test_supervisor_runs_the_plans_trainer_command(tmp_path):
    cfg = RootConfig(cluster=ClusterConfig(kind="local", nodes=1, buffers=0), parallel=ParallelConfig(dp=1),
                     train=TrainConfig(steps=3, global_batch_size=4, ckpt_interval=2),
                     health=HealthConfig(preflight=False),
                     supervisor=SupervisorConfig(poll_s=0.05, trainer_command=[sys.executable, FAKE]),
                     run=RunConfig(name="p", root=str(tmp_path)))
    rd = RunDir(tmp_path / "p").make()
    dump_config(cfg, rd.config)
    marker = tmp_path / "ran-the-plan"
    wrapper = ["sh", "-c", f'touch {marker} && exec "$0" "$@"', sys.executable, FAKE, "--run-dir", str(rd.root)]
    write_plan(replace(plan(cfg, run_dir=str(rd.root)), trainer_argv=tuple(wrapper)), rd.root)
    assert Supervisor(cfg, rd).run() == 0
    assert marker.exists()  # the command came from plan.json, not from supervisor.trainer_command


def test_moe_launch_writes_the_plan_it_printed(tmp_path):
    proc = subprocess.run([MOE_LAUNCH, "run.name=w", "train.steps=2", "health.preflight=false",
                           f"supervisor.trainer_command=[{sys.executable},{FAKE}]", "supervisor.poll_s=0.1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = json.loads((tmp_path / "runs" / "w" / "plan.json").read_text())
    assert written["trainer_argv"][-2:] == ["--run-dir", str(tmp_path / "runs" / "w")]
    assert written["local_nodes"] == ["local1", "local2", "local3"]
