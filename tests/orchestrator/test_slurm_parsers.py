"""Pure parsers of slurm.py, on output captured from Slurm 22.05 on the local test cluster (tests/slurm/cluster.sh)."""

from __future__ import annotations

import socket

from moe_launch.orchestrator.slurm import (
    backoff_delays,
    is_bad_state,
    is_controller_error,
    parse_job_field,
    parse_srun_line,
    parse_time_limit,
)
from moe_launch.rundir import node_name, slurm_node_of_host

# srun's stderr when node5 was hard-failed during `srun -N 2 -w node4,node5 --kill-on-bad-exit=1 ...`
NODE_FAILURE = """\
srun: error: Node failure on node5
slurmstepd-node4: error: *** STEP 7.0 ON node4 CANCELLED AT 2026-11-30T19:41:07 DUE TO NODE FAILURE, SEE SLURMCTLD \
LOG FOR DETAILS ***
srun: Job step aborted: Waiting up to 7 seconds for job step to finish.
srun: error: node4: task 0: Terminated
srun: launch/slurm: _step_signal: Terminating StepId=7.0
"""
# ... and when the task on node5 exited 3 (a soft fault) and srun ended the others
TASK_EXIT = """\
srun: error: node5: task 1: Exited with exit code 3
srun: launch/slurm: _step_signal: Terminating StepId=8.0
slurmstepd-node4: error: *** STEP 8.0 ON node4 CANCELLED AT 2026-11-30T19:41:16 ***
srun: error: node4: task 0: Terminated
srun: Force Terminated StepId=8.0
srun: error: node2: tasks 0-1: Killed
"""
SCONTROL_JOB = ("JobId=9 JobName=job.sh UserId=root(0) JobState=RUNNING Reason=None ReqNodeList=node[3-5] "
                "ExcNodeList=(null) NodeList=node[3-4] BatchHost=node3 NumNodes=2 NumCPUs=2")


def test_srun_lines():
    parsed = [p for p in map(parse_srun_line, NODE_FAILURE.splitlines()) if p]
    assert parsed == [("node_failure", "node5", "srun: error: Node failure on node5"),
                      ("signal", "node4", "Terminated")]
    parsed = [p for p in map(parse_srun_line, TASK_EXIT.splitlines()) if p]
    assert parsed == [("exit", "node5", "3"), ("signal", "node4", "Terminated"), ("signal", "node2", "Killed")]
    assert parse_srun_line("[rank0]: RuntimeError: Connection closed by peer") is None


def test_scontrol_job_fields():
    assert parse_job_field(SCONTROL_JOB, "NodeList") == "node[3-4]"  # not ReqNodeList / ExcNodeList
    assert parse_job_field(SCONTROL_JOB, "JobState") == "RUNNING"
    assert parse_job_field(SCONTROL_JOB, "Missing") is None


def test_time_limits_and_states():
    assert parse_time_limit("infinite") is None
    assert parse_time_limit("30:00") == 30
    assert parse_time_limit("1:00:00") == 60
    assert parse_time_limit("2-00:00:00") == 2 * 24 * 60
    assert parse_time_limit("0:30") == 1  # 30 seconds round up to a minute
    for bad in ("down*", "idle*", "drained", "draining", "fail", "down"):
        assert is_bad_state(bad), bad
    for ok in ("idle", "mixed", "allocated", "completing"):
        assert not is_bad_state(ok), ok


# `scontrol show node -o` on the local test cluster (two of its lines, cut after the fields that matter)
SCONTROL_NODES = """\
NodeName=node1 Arch=x86_64 CoresPerSocket=2  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=3.42 \
AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.100.1 NodeHostName=node1 Port=17901 \
Version=22.05.8 OS=Linux 6.18.44-fc-v973 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4096 State=IDLE Partitions=debug
NodeName=node2 Arch=x86_64 CoresPerSocket=2  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=3.42 \
AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.100.2 NodeHostName=gpu-b07.hpc.example \
Port=17902 Version=22.05.8 OS=Linux 6.18.44-fc-v973 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4096 State=IDLE
"""


def test_node_name_is_the_slurm_node_name_not_the_hostname():
    assert slurm_node_of_host(SCONTROL_NODES, "node1.hpc.example") == "node1"  # FQDN of NodeHostName=node1
    assert slurm_node_of_host(SCONTROL_NODES, "gpu-b07.hpc.example") == "node2"  # NodeHostName differs from NodeName
    assert slurm_node_of_host(SCONTROL_NODES, "127.0.100.2") == "node2"
    assert slurm_node_of_host(SCONTROL_NODES, "login1.hpc.example") is None
    env = {"SLURMD_NODENAME": "node4", "SLURM_JOB_ID": "7"}
    assert node_name(env) == "node4"
    assert node_name({**env, "MOE_LAUNCH_NODE": "local2"}) == "local2"  # cluster=local names its "nodes" itself
    assert node_name({}) == socket.gethostname()  # outside Slurm


# srun's stderr when a dead spare (node5: slurmd killed, not yet noticed by slurmctld) was part of a new step
LAUNCH_FAILED = """\
srun: error: Task launch for StepId=31.4 failed on node node5: Communication connection failure
srun: error: Application launch failed: Communication connection failure
srun: Job step aborted: Waiting up to 7 seconds for job step to finish.
srun: error: node2: task 0: Killed
"""


def test_failed_task_launch_names_its_node():
    parsed = [p for p in map(parse_srun_line, LAUNCH_FAILED.splitlines()) if p]
    assert parsed[0] == ("node_failure", "node5", LAUNCH_FAILED.splitlines()[0])
    assert parsed[1:] == [("signal", "node2", "Killed")]  # the peer srun killed: SlurmStep does not blame it


def test_controller_errors_are_transient_and_retried_with_backoff():
    assert is_controller_error("srun: error: Unable to allocate resources: Unable to contact slurm controller "
                               "(connect failure)")
    assert is_controller_error("slurm_load_jobs error: Socket timed out on send/recv operation")
    assert not is_controller_error("sbatch: error: Batch job submission failed: Invalid partition name specified")
    assert not is_controller_error(LAUNCH_FAILED.splitlines()[0])  # a dead node is no controller outage
    assert backoff_delays(0) == []
    delays = backoff_delays(300)
    assert delays[:5] == [1, 2, 4, 8, 15] and max(delays) == 15 and 285 < sum(delays) <= 300
