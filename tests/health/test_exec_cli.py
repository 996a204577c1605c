"""srun argument building, local rank environments, CLI config loading, release."""

from __future__ import annotations

import pytest

from moe_launch.conf.schema import ClusterConfig
from moe_launch.errors import ConfigError
from moe_launch.health.cli import expand_nodes, load_configs
from moe_launch.health.cli import main as health_cli
from moe_launch.health.exec import rank_env, run_per_node, srun_argv


def test_srun_argv_outside_and_inside_an_allocation():
    c = ClusterConfig(kind="slurm", partition="gpu", account="proj", cpus_per_task=4, gpus_per_node=8)
    outside = srun_argv(c, ["node1", "node2"], 8, timeout_s=300, inside_allocation=False)
    assert outside[:5] == ["srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--nodelist=node1,node2"]
    for arg in ("--immediate=30", "--time=6", "--partition=gpu", "--account=proj", "--cpus-per-task=4",
                "--gpus-per-node=8", "--kill-on-bad-exit=1"):
        assert arg in outside
    assert "--qos" not in " ".join(outside) and "--overlap" not in outside
    inside = srun_argv(c, ["node3"], 1, timeout_s=30, inside_allocation=True)
    assert "--overlap" in inside and not any(a.startswith(("--immediate", "--partition", "--time")) for a in inside)


def test_rank_env():
    env = rank_env("local2", rank=3, local_rank=1, world=4, master_addr="127.0.0.1", master_port=29555)
    assert env["MOE_LAUNCH_NODE"] == "local2" and env["RANK"] == "3" and env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == "4" and env["MASTER_PORT"] == "29555"


def test_local_tasks_see_their_node_name():
    c = ClusterConfig(kind="local")
    code = "from moe_launch.rundir import node_name; print(node_name())"
    out = run_per_node(["local1", "local2"], [c.python or "python3", "-c", code], c, timeout_s=60)
    assert {n: o.stdout.strip() for n, o in out.items()} == {"local1": "local1", "local2": "local2"}
    slow = run_per_node(["local1"], ["sleep", "30"], c, timeout_s=0.5)
    assert slow["local1"].timed_out and not slow["local1"].ok


def test_load_configs_and_errors():
    health, cluster = load_configs(None, "slurm", ["health.alltoall.iters=2", "cluster.name=prod",
                                                   "health.inject_delay={node2: 0.5}"])
    assert health.alltoall.iters == 2 and cluster.name == "prod" and cluster.kind == "slurm"
    assert health.inject_delay == {"node2": 0.5}
    with pytest.raises(ConfigError, match="health.alltoall.threshold"):
        load_configs(None, "slurm", ["health.alltoall.threshold=1.5"])
    with pytest.raises(ConfigError, match="moe-health only reads"):
        load_configs(None, "slurm", ["train.lr=1"])
    with pytest.raises(ConfigError, match="--cluster"):
        load_configs(None, "nope", [])
    assert expand_nodes("a,b,c") == ["a", "b", "c"]


def test_release_cli(tmp_path, capsys):
    from moe_launch.health import store

    cdir = tmp_path / "c9"
    cdir.mkdir()
    (cdir / "quarantine.json").write_text('{"quarantined": {"node5": {"since": 1, "failures": 3}}, "released": {}}')
    rc = health_cli(["release", "node5", "--cluster", "local", "cluster.name=c9", f"health.store_dir={tmp_path}"])
    assert rc == 0
    assert "released from quarantine" in capsys.readouterr().out
    assert store.quarantined_nodes(cdir) == {}
