"""cluster=local on GPU machines: each step's ranks on their own GPU, preflight of nodes sharing a GPU never
concurrent, the default layout fitted to the GPUs present (and said so). The GPU count comes from
CUDA_VISIBLE_DEVICES, so these run on a CPU machine; the processes and `moe-launch` itself are real."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from e2e_util import MOE_LAUNCH

from moe_launch.conf.schema import ClusterConfig, ParallelConfig, RootConfig
from moe_launch.errors import ConfigError
from moe_launch.health.exec import run_per_node
from moe_launch.orchestrator.local_cluster import LocalCluster
from moe_launch.orchestrator.local_gpus import (
    fit_layout,
    layout_overridden,
    preflight_waves,
    step_devices,
    visible_gpus,
)

DEFAULT = RootConfig(cluster=ClusterConfig(kind="local", nodes=2, buffers=1), parallel=ParallelConfig(dp=2))


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ("2", "3")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == ()


def test_default_layout_fits_the_gpus_and_says_so():
    same, note = fit_layout(DEFAULT, 0, user_layout=False)
    assert same is DEFAULT and note is None  # CPU machine: unchanged
    one, note = fit_layout(DEFAULT, 1, user_layout=False)
    assert (one.cluster.nodes, one.cluster.buffers, one.parallel.dp) == (1, 1, 1)
    assert "cluster.nodes=1" in note and "parallel.dp=1" in note
    two, note = fit_layout(DEFAULT, 2, user_layout=False)
    assert (two.cluster.nodes, two.parallel.dp) == (2, 2) and "2 trainer rank(s) on 2 GPU(s)" in note


def test_a_chosen_layout_with_more_ranks_than_gpus_is_refused():
    with pytest.raises(ConfigError, match="cluster.nodes.*2 GPU ranks but this machine has 1 GPU"):
        fit_layout(DEFAULT, 1, user_layout=True)
    ep2 = replace(DEFAULT, parallel=ParallelConfig(dp=1, ep=2))
    with pytest.raises(ConfigError, match="ep\\*pp = 2 does not divide"):
        fit_layout(ep2, 1, user_layout=False)
    assert layout_overridden(["cluster.nodes=3"]) and layout_overridden(["parallel=single"])
    assert layout_overridden(["+parallel.dp=1"]) and not layout_overridden(["cluster.buffers=2", "train.steps=3"])


def test_each_node_of_a_step_gets_its_own_gpus():
    assert step_devices(("local1", "local3"), ("0", "1"), 1) == {"local1": "0", "local3": "1"}
    assert step_devices(("a", "b"), ("4", "5", "6", "7"), 2) == {"a": "4,5", "b": "6,7"}
    assert step_devices(("a", "b"), (), 1) == {}
    with pytest.raises(ConfigError):
        step_devices(("a", "b"), ("0",), 1)


def test_preflight_waves_never_put_two_nodes_on_one_gpu():
    assert preflight_waves(["a", "b", "c"], ("0",), 1) == [{"a": "0"}, {"b": "0"}, {"c": "0"}]
    assert preflight_waves(["a", "b", "c"], ("0", "1"), 1) == [{"a": "0", "b": "1"}, {"c": "0"}]
    assert preflight_waves(["a", "b"], (), 1) == [{"a": "", "b": ""}]


_REPORT = ("import os, sys, time, json; t0 = time.time(); time.sleep(0.4); "
           "open(sys.argv[1] + '/' + os.environ['MOE_LAUNCH_NODE'] + '-' + os.environ.get('RANK', 'x'), 'w')"
           ".write(json.dumps([os.environ.get('CUDA_VISIBLE_DEVICES'), t0, time.time()]))")


def test_local_step_gives_each_node_its_gpu(tmp_path):
    cluster = LocalCluster(("local1", "local2", "local3"), tasks_per_node=1, gpus=("0", "1"))
    step = cluster.launch(("local2", "local3"), 0, [sys.executable, "-c", _REPORT, str(tmp_path)], {"MASTER_PORT": "1"},
                          tmp_path / "logs")
    assert step.wait(60)
    seen = {p.name: json.loads(p.read_text())[0] for p in tmp_path.glob("local*")}
    assert seen == {"local2-0": "0", "local3-1": "1"}


def test_preflight_of_nodes_sharing_a_gpu_never_overlaps(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    outcomes = run_per_node(["local1", "local2", "local3"], [sys.executable, "-c", _REPORT, str(tmp_path)],
                            ClusterConfig(kind="local"), 60)
    assert all(o.ok for o in outcomes.values()), outcomes
    spans = sorted(json.loads(p.read_text()) for p in tmp_path.glob("local*"))
    assert [s[0] for s in spans] == ["0", "0", "0"]
    for (_, _, end), (_, start, _) in zip(spans, spans[1:]):
        assert end <= start  # one after another: each started after the previous one ended


def _cli(tmp_path, gpus: str, *args):
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    return subprocess.run([MOE_LAUNCH, "--dry-run", "run.name=g", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)


def test_dry_run_fits_the_default_layout_to_one_gpu(tmp_path):
    t0 = time.perf_counter()
    one = _cli(tmp_path, "0")
    assert one.returncode == 0, one.stderr
    assert "1 GPU(s): the default layout is fitted to them: cluster.nodes=1, parallel.dp=1" in one.stderr
    plan = json.loads(one.stdout.split("# launch plan\n", 1)[1].split("\n# ", 1)[0])
    assert (plan["nodes"], plan["buffers"]) == (1, 1)
    refused = _cli(tmp_path, "0", "cluster.nodes=2", "parallel.dp=2")
    assert refused.returncode == 2 and "cluster.nodes" in refused.stderr and "1 GPU" in refused.stderr
    cpu = _cli(tmp_path, "")
    assert cpu.returncode == 0 and "GPU" not in cpu.stderr
    plan = json.loads(cpu.stdout.split("# launch plan\n", 1)[1].split("\n# ", 1)[0])
    assert plan["nodes"] == 2
    print(f"\nthree dry runs in {time.perf_counter() - t0:.1f} s")
