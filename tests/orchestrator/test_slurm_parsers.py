"""Pure parsers of slurm.py, on output captured from Slurm 22.05 on the local test cluster (tests/slurm/cluster.sh)."""

from __future__ import annotations

from moe_launch.orchestrator.slurm import is_bad_state, parse_job_field, parse_srun_line, parse_time_limit

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
