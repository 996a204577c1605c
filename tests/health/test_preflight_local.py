"""Preflight end to end with cluster.kind=local: real subprocesses per node, real gloo all-to-all, real files.

(The Slurm versions of these scenarios are in test_preflight_slurm.py.)"""

from __future__ import annotations

import json

import pytest

from moe_launch.conf.schema import AllToAllConfig, ClusterConfig, DcgmConfig, HealthConfig
from moe_launch.health import store
from moe_launch.health.dcgm import DCGMI_DIR_ENV
from moe_launch.health.dcgm_double import install_double
from moe_launch.health.preflight import run_preflight

NODES = ["local1", "local2", "local3", "local4"]


def _cfg(tmp_path, **kw) -> HealthConfig:
    # threshold 0.1: this 2-core machine is shared (another test worker runs beside), and small gloo transfers vary
    # by several x between runs (a healthy node once measured over 4x below its baseline); the injected delay slows
    # a group by ~100x, so the test stays unambiguous
    a2a = AllToAllConfig(min_bytes=1024, max_bytes=4096, iters=3, threshold=0.1,
                         baseline_path=str(tmp_path / "baselines.json"), timeout_s=120)
    return HealthConfig(store_dir=str(tmp_path / "store"), alltoall=a2a, **kw)


def test_healthy_then_dcgm_failure_on_one_node(tmp_path, monkeypatch):
    cluster = ClusterConfig(kind="local", name="t-local")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv(DCGMI_DIR_ENV, str(tmp_path / "doubles"))
    for node in NODES:
        install_double(tmp_path / "doubles", node, "dcgm_pass.json")
    cfg = _cfg(tmp_path)
    first = run_preflight(NODES, cfg, cluster, tmp_path / "health", "run1")
    assert first.healthy == NODES and first.failed == {}, first.to_json()
    assert {r.check for r in first.results} == {"dcgm", "compute", "alltoall"}
    assert all(r.status == "pass" for r in first.results)
    assert json.loads((tmp_path / "baselines.json").read_text())["alltoall"]  # first healthy run recorded

    install_double(tmp_path / "doubles", "local3", "dcgm_fail_memory.json", returncode=226)
    second = run_preflight(NODES, _cfg(tmp_path, gpu_check=False), cluster, tmp_path / "health", "run2")
    assert second.healthy == ["local1", "local2", "local4"]
    assert list(second.failed) == ["local3"] and "Row Remap" in second.failed["local3"][0]
    assert second.alltoall["nodes"] == ["local1", "local2", "local4"]  # a failed node is kept out of the all-to-all
    raw = tmp_path / "health" / "preflight-002" / "nodes" / "raw" / "local3.dcgm.txt"
    assert "Row Remap" in raw.read_text()  # DCGM's own output is kept for a human
    assert json.loads((tmp_path / "health" / "preflight.json").read_text())["failed"] == second.failed
    history = store.read_history(store.cluster_dir(cfg, "t-local"))
    assert {"run1", "run2"} == {h["run"] for h in history}
    assert [h["node"] for h in history if h["status"] == "fail"] == ["local3"]


@pytest.mark.slow  # ~45 s: six all-to-all runs; the Slurm test covers the same path on real srun
def test_delay_on_one_node_is_isolated(tmp_path):
    cluster = ClusterConfig(kind="local", name="t-local")
    base = _cfg(tmp_path, gpu_check=False, dcgm=DcgmConfig(enabled=False))
    assert run_preflight(NODES, base, cluster, tmp_path / "health", "ok").ok
    slow = _cfg(tmp_path, gpu_check=False, dcgm=DcgmConfig(enabled=False), inject_delay={"local2": 0.2})
    result = run_preflight(NODES, slow, cluster, tmp_path / "health", "slow")
    assert result.alltoall["status"] == "fail"
    assert result.isolation["bad"] == ["local2"], result.isolation
    assert result.healthy == ["local1", "local3", "local4"] and list(result.failed) == ["local2"]
    assert len(result.isolation["tests"]) <= 6  # halves, anchor pairs, the slow pair measured again
    # `moe-health baseline`: re-record on purpose, even though the stored value is better than today's
    rerecord = run_preflight(NODES, base, cluster, tmp_path / "health", "rebase", force_baseline=True)
    assert rerecord.ok
    stored = json.loads((tmp_path / "baselines.json").read_text())["alltoall"]
    assert {v["run"] for v in stored.values()} == {"rebase"}


def test_repeated_failures_quarantine_a_node_until_released(tmp_path, monkeypatch):
    cluster = ClusterConfig(kind="local", name="t-q")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv(DCGMI_DIR_ENV, str(tmp_path / "doubles"))
    install_double(tmp_path / "doubles", "local2", "dcgm_fail_memory.json", returncode=226)
    cfg = _cfg(tmp_path, gpu_check=False, quarantine_failures=2)
    cfg.alltoall.enabled = False
    nodes = ["local1", "local2"]
    for run in ("q1", "q2"):
        r = run_preflight(nodes, cfg, cluster, tmp_path / "health", run)
        assert list(r.failed) == ["local2"] and r.quarantined == []
    cdir = store.cluster_dir(cfg, "t-q")
    assert store.quarantined_nodes(cdir)["local2"]["failures"] == 2
    held = run_preflight(nodes, cfg, cluster, tmp_path / "health", "q3")
    assert held.quarantined == ["local2"] and "moe-health release local2" in held.failed["local2"][0]
    assert [r.node for r in held.results] == ["local1"]  # a quarantined node is not even tested
    store.release(cdir, "local2")
    install_double(tmp_path / "doubles", "local2", "dcgm_pass.json")
    assert run_preflight(nodes, cfg, cluster, tmp_path / "health", "q4").healthy == nodes
