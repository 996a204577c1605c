"""Pure tests of plan() and render_sbatch(): golden files, hostile values, impossible requests."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from moe_launch.conf.schema import ClusterConfig, ParallelConfig, RootConfig, RunConfig, TrainConfig
from moe_launch.errors import ConfigError
from moe_launch.orchestrator.plan import PartitionInfo, plan
from moe_launch.orchestrator.render import render_sbatch

GOLDEN = Path(__file__).parent.parent / "golden"
PART = PartitionInfo(name="debug", nodes=tuple(f"node{i}" for i in range(1, 7)), max_time_min=120)


def slurm_cfg(**cluster) -> RootConfig:
    c = dict(kind="slurm", nodes=2, buffers=2, tasks_per_node=1, time_limit_min=30, python="/usr/bin/python3")
    c.update(cluster)
    return RootConfig(cluster=ClusterConfig(**c), parallel=ParallelConfig(dp=c["nodes"] * c["tasks_per_node"]),
                      run=RunConfig(name="golden"), train=TrainConfig(micro_batch_size=1, global_batch_size=8))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("MOE_LAUNCH_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; re-run with MOE_LAUNCH_UPDATE_GOLDEN=1 if intended"


def test_render_basic_matches_golden():
    p = plan(slurm_cfg(partition="debug"), PART, run_dir="/runs/golden")
    text = render_sbatch(p)
    check_golden("sbatch_basic.sh", text)
    for flag in ("#SBATCH --nodes=4", "#SBATCH --no-kill", "#SBATCH --no-requeue", "#SBATCH --signal=B:USR2@60"):
        assert flag in text.splitlines()


HOSTILE = dict(partition="$(id)", account="`id`", qos="a; rm -rf ~", exclude=["node2"],
               extra_sbatch=["--comment=$(id); rm -rf ~", "--mail-user=x'y z"], python="/opt/my env/bin/python")


def hostile_plan(python=None):
    cfg = slurm_cfg(**{**HOSTILE, **({"python": python} if python else {})})
    cfg.run.name = "a; rm -rf ~"
    part = PartitionInfo(name="$(id)", nodes=PART.nodes)
    return plan(cfg, part, quarantined=["node5"], run_dir="/tmp/r $(id)/a; rm -rf ~")


def test_render_hostile_values_matches_golden_and_stays_literal():
    p = hostile_plan()
    assert p.exclude == ("node2", "node5")
    assert any("node5" in w for w in p.warnings)
    text = render_sbatch(p)
    check_golden("sbatch_hostile.sh", text)
    # sbatch groups quotes like the shell: every #SBATCH line must split back into exactly one literal word
    sbatch_lines = [ln[len("#SBATCH "):] for ln in text.splitlines() if ln.startswith("#SBATCH ")]
    words = [shlex.split(ln) for ln in sbatch_lines]
    assert all(len(w) == 1 for w in words), words
    assert "--job-name=moe-launch:a; rm -rf ~" in [w[0] for w in words]
    assert "--comment=$(id); rm -rf ~" in [w[0] for w in words]
    assert "--mail-user=x'y z" in [w[0] for w in words]


def test_unknown_excluded_node_is_refused():
    """A typo in cluster.exclude would let the node the user meant to avoid into the job."""
    with pytest.raises(ConfigError, match=r"cluster.exclude: node\(s\) not in partition debug: \$\(reboot\), node9"):
        plan(slurm_cfg(exclude=["node2", "$(reboot)", "node9"]), PART)


def test_rendered_script_runs_hostile_values_as_plain_arguments(tmp_path):
    """Run the script's body with `printf` standing in for python: the argv comes back literal, nothing executes."""
    run_dir = tmp_path / "r $(touch pwned)" / "a; rm -rf ~"
    run_dir.mkdir(parents=True)
    cfg = slurm_cfg(python="/usr/bin/printf")
    cfg.run.name = "x"
    p = plan(cfg, PART, run_dir=str(run_dir))
    script = render_sbatch(p).replace("exec /usr/bin/printf", "exec /usr/bin/printf '%s\\n'")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         check=True).stdout.splitlines()
    assert out == ["-m", "moe_launch.orchestrator.supervisor", "--run-dir", str(run_dir)]
    assert not list(tmp_path.rglob("pwned"))


def test_plan_local_names_nodes():
    cfg = RootConfig(cluster=ClusterConfig(kind="local", nodes=2, buffers=1), parallel=ParallelConfig(dp=2))
    p = plan(cfg, None, run_dir="/x")
    assert p.local_nodes == ("local1", "local2", "local3") and p.total_nodes == 3


def test_impossible_requests_fail_before_submission():
    with pytest.raises(ConfigError, match="cluster.nodes") as e:
        plan(slurm_cfg(nodes=4, buffers=3), PART)
    assert "partition debug has 6" in str(e.value)
    with pytest.raises(ConfigError, match="cluster.partition"):
        plan(slurm_cfg(partition="gpu"), None)
    with pytest.raises(ConfigError, match="cluster.time_limit_min"):
        plan(slurm_cfg(time_limit_min=500), PART)
    with pytest.raises(ConfigError, match="cluster.time_limit_min"):
        plan(slurm_cfg(time_limit_min=1, signal_before_end_s=60), PART)
    with pytest.raises(ConfigError, match=r"cluster.extra_sbatch\[0\]"):
        plan(slurm_cfg(extra_sbatch=["--comment=a\nb"]), PART)
    # exclusions shrink what the partition can give
    with pytest.raises(ConfigError, match="excluded/quarantined"):
        plan(slurm_cfg(nodes=2, buffers=2, exclude=["node1"]), PART, quarantined=["node2", "node3"])


def test_down_nodes_warn_but_do_not_fail():
    part = PartitionInfo(name="debug", nodes=PART.nodes, unavailable=("node1", "node2", "node3"))
    p = plan(slurm_cfg(nodes=2, buffers=2), part)
    assert any("will pend" in w for w in p.warnings)


def test_sbatch_example_is_what_the_renderer_makes():
    cfg = slurm_cfg(nodes=2, buffers=2, python="/opt/moe-launch/.venv/bin/python")
    cfg.run.name = "tiny-moe-2+2"
    text = render_sbatch(plan(cfg, PART, run_dir="/home/me/moe-launch/runs/tiny-moe-2+2"))
    path = Path(__file__).parent.parent.parent / "sbatch" / "tiny-moe-2+2.sh"
    if os.environ.get("MOE_LAUNCH_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text()


def test_time_limit_warning_goes_to_the_supervisor_or_nowhere():
    text = render_sbatch(plan(slurm_cfg(signal_before_end_s=90), PART))
    assert "#SBATCH --signal=B:USR2@90" in text.splitlines()  # B: the batch step, never the trainer directly
    text = render_sbatch(plan(slurm_cfg(signal_before_end_s=0), PART))
    assert "--signal" not in text  # 0: no warning at all
