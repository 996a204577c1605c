"""srun argument building, local ranks through the local launcher, CLI config loading, release."""

from __future__ import annotations

import pytest

from moe_launch.conf.schema import ClusterConfig
from moe_launch.errors import ConfigError
from moe_launch.health.cli import expand_nodes, load_configs
from moe_launch.health.cli import main as health_cli
from moe_launch.health.exec import health_srun_argv, run_per_node, run_ranks


def test_srun_argv_outside_and_inside_an_allocation():
    c = ClusterConfig(kind="slurm", partition="gpu", account="proj", cpus_per_task=4, gpus_per_node=8)
    outside = health_srun_argv(c, ["node1", "node2"], 8, timeout_s=300, inside_allocation=False)
    assert outside[:5] == ["srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--nodelist=node1,node2"]
    for arg in ("--immediate=30", "--time=6", "--partition=gpu", "--account=proj", "--cpus-per-task=4",
                "--gpus-per-node=8", "--kill-on-bad-exit=1"):
        assert arg in outside
    assert "--qos" not in " ".join(outside) and "--overlap" not in outside
    inside = health_srun_argv(c, ["node3"], 1, timeout_s=30, inside_allocation=True)
    assert "--overlap" in inside and not any(a.startswith(("--immediate", "--partition", "--time")) for a in inside)


def test_local_ranks_get_their_environment_from_the_local_launcher():
    c = ClusterConfig(kind="local")
    code = ("import os; print(' '.join(os.environ[k] for k in ('MOE_LAUNCH_NODE', 'RANK', 'LOCAL_RANK', 'WORLD_SIZE',"
            " 'MASTER_ADDR')))")
    out = run_ranks(["local1", "local2"], 2, [c.python or "python3", "-c", code], c, timeout_s=60)
    assert out.ok, out.stdout
    assert sorted(out.stdout.split("\n")[:-1]) == ["local1 0 0 4 127.0.0.1", "local1 1 1 4 127.0.0.1",
                                                    "local2 2 0 4 127.0.0.1", "local2 3 1 4 127.0.0.1"]
    bad = run_ranks(["local1", "local2"], 1, [c.python or "python3", "-c",
                                              "import os, sys, time; os.environ['RANK'] == '1' and sys.exit(3); "
                                              "time.sleep(60)"], c, timeout_s=60)
    assert bad.returncode == 3 and not bad.timed_out  # one bad exit ends the gang, like srun --kill-on-bad-exit


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
