"""orchestrator/srun.py, the one srun builder, and the argv each of its callers starts: the trainer step, the node
probe (slurm.py) and the health tasks (health/exec.py)."""

from __future__ import annotations

import subprocess

import pytest

from moe_launch.conf.schema import ClusterConfig
from moe_launch.health import exec as health_exec
from moe_launch.orchestrator import slurm
from moe_launch.orchestrator.srun import NewAllocation, srun_argv

GPU = ClusterConfig(kind="slurm", partition="gpu", account="proj", qos="high", tasks_per_node=8, cpus_per_task=4,
                    gpus_per_node=8)
CPU = ClusterConfig(kind="slurm", tasks_per_node=1, cpus_per_task=1)


def test_the_minimal_prefix_names_nodes_tasks_and_job():
    assert srun_argv(["node1"], 1, "x") == ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
                                            "--nodelist=node1", "--job-name=x"]
    argv = srun_argv(("node2", "node1", "node3"), 4, "x")
    assert argv[1:5] == ["--nodes=3", "--ntasks=12", "--ntasks-per-node=4", "--nodelist=node2,node1,node3"]


def test_every_option_appears_once_and_only_when_asked():
    step = srun_argv(["n1", "n2"], 2, "s", job_id="42", overlap=True, cpus_per_task=3, gpus_per_node=2,
                     kill_on_bad_exit=True, export_all=True)
    assert step[5:] == ["--cpus-per-task=3", "--kill-on-bad-exit=1", "--job-name=s", "--export=ALL", "--jobid=42",
                        "--overlap", "--gpus-per-node=2"]
    fresh = srun_argv(["n1"], 1, "h", new_allocation=NewAllocation(time_min=6, immediate_s=30, partition="p",
                                                                    account="a", qos="q"))
    assert fresh[5:] == ["--job-name=h", "--immediate=30", "--time=6", "--partition=p", "--account=a", "--qos=q"]
    bare = srun_argv(["n1"], 1, "h", new_allocation=NewAllocation(time_min=1))
    assert bare[5:] == ["--job-name=h", "--time=1"]
    # 0 CPUs per task is the caller's value, passed on (Slurm answers it); 0 GPUs means "no GPU request"
    assert "--cpus-per-task=0" in srun_argv(["n1"], 1, "x", cpus_per_task=0)
    assert not any(a.startswith("--gpus") for a in srun_argv(["n1"], 1, "x", gpus_per_node=0))


def test_contradictory_or_empty_requests_are_refused():
    with pytest.raises(ValueError, match="job_id/overlap"):
        srun_argv(["n1"], 1, "x", job_id="7", new_allocation=NewAllocation(time_min=1))
    with pytest.raises(ValueError, match="job_id/overlap"):
        srun_argv(["n1"], 1, "x", overlap=True, new_allocation=NewAllocation(time_min=1))
    with pytest.raises(ValueError, match="at least one node"):
        srun_argv([], 1, "x")
    with pytest.raises(ValueError, match="one task per node"):
        srun_argv(["n1"], 0, "x")


def test_trainer_step_is_an_overlapping_gang_step_of_the_job():
    assert slurm.step_argv("123", ("node3", "node1"), "moe-attempt-2", GPU) == [
        "srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--nodelist=node3,node1", "--cpus-per-task=4",
        "--kill-on-bad-exit=1", "--job-name=moe-attempt-2", "--jobid=123", "--overlap", "--gpus-per-node=8"]
    # the allocation's partition/account/qos belong to sbatch, never to a step
    assert not any(a.startswith(("--partition", "--account", "--qos", "--time", "--immediate"))
                   for a in slurm.step_argv("123", ("node1",), "s", GPU))
    assert "--gpus-per-node" not in " ".join(slurm.step_argv("9", ("node1",), "s", CPU))


def test_probe_is_one_task_on_one_node_of_the_job():
    assert slurm.probe_argv("77", "node5") == [
        "srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=node5", "--job-name=moe-probe",
        "--jobid=77", "--overlap", "echo", "moe-probe-ok"]


def test_health_tasks_inside_and_outside_an_allocation():
    inside = health_exec.health_srun_argv(GPU, ["node1", "node2"], 8, timeout_s=30, inside_allocation=True)
    assert inside == ["srun", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--nodelist=node1,node2",
                      "--cpus-per-task=4", "--kill-on-bad-exit=1", "--job-name=moe-health", "--export=ALL",
                      "--overlap", "--gpus-per-node=8"]
    outside = health_exec.health_srun_argv(GPU, ["node1"], 1, timeout_s=300, inside_allocation=False)
    assert outside == ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=node1",
                       "--cpus-per-task=4", "--kill-on-bad-exit=1", "--job-name=moe-health", "--export=ALL",
                       "--immediate=30", "--time=6", "--partition=gpu", "--account=proj", "--qos=high",
                       "--gpus-per-node=8"]
    # the time limit covers the timeout, in whole minutes, at least one
    for timeout_s, minutes in ((5, 1), (59.9, 1), (60, 2), (3600, 61)):
        argv = health_exec.health_srun_argv(CPU, ["node1"], 1, timeout_s=timeout_s, inside_allocation=False)
        assert f"--time={minutes}" in argv and not any(a.startswith(("--partition", "--qos")) for a in argv)


class _Recorder:
    """Stands in for the process launcher only: records the argv each caller hands to it."""

    argvs: list[list[str]] = []

    def __init__(self, argv, **_kwargs):
        type(self).argvs.append(list(argv))
        self.pid, self.returncode, self.stderr = 0, 0, iter(())

    def communicate(self, timeout=None):
        return b"moe-probe-ok\n", b""

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


def test_the_callers_start_exactly_the_built_argv(monkeypatch, tmp_path):
    """probe_nodes and SlurmStep hand srun the builder's argv, not one of their own."""
    _Recorder.argvs = []
    monkeypatch.setattr(subprocess, "Popen", _Recorder)
    assert slurm.probe_nodes("77", ("node1", "node2"), 1.0) == {"node1", "node2"}
    assert _Recorder.argvs == [slurm.probe_argv("77", "node1"), slurm.probe_argv("77", "node2")]
    _Recorder.argvs = []
    step = slurm.SlurmStep("123", ("node1", "node2"), 3, ["python", "-m", "train"], {"K": "V"}, GPU, tmp_path, 5.0)
    assert _Recorder.argvs == [slurm.step_argv("123", ("node1", "node2"), "moe-attempt-3", GPU)
                               + ["python", "-m", "train"]]
    assert step.env["K"] == "V"


def test_health_tasks_start_exactly_the_built_argv(monkeypatch):
    started: list[list[str]] = []
    monkeypatch.setattr(health_exec, "_start", lambda argv, env: started.append(argv) or argv)
    monkeypatch.setattr(health_exec, "_collect", lambda tasks, timeout_s: dict.fromkeys(tasks))
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    health_exec.run_per_node(["node1", "node2"], ["check"], CPU, timeout_s=30)
    assert started == [health_exec.health_srun_argv(CPU, [n], 1, 30, True) + ["check"] for n in ("node1", "node2")]
    started.clear()
    monkeypatch.delenv("SLURM_JOB_ID")
    health_exec.run_ranks(["node1", "node2"], 2, ["a2a"], CPU, timeout_s=30)
    assert started == [health_exec.health_srun_argv(CPU, ["node1", "node2"], 2, 30, False) + ["a2a"]]
