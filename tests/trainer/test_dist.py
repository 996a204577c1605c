"""Rank / rendezvous detection from torchrun and Slurm environments (pure)."""

import pytest

from moe_launch.errors import ConfigError
from moe_launch.trainer.dist import detect_env


def _no_scontrol(nodelist):
    raise AssertionError("scontrol must not be needed when MASTER_ADDR is given")


def test_torchrun_env():
    env = detect_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"},
                     hostnames=_no_scontrol)
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == \
        (3, 4, 1, "n1", 1234, "torchrun")


def test_slurm_env_prefers_explicit_master():
    env = detect_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "node[3-4]",
                      "MASTER_ADDR": "node4", "MASTER_PORT": "29511"}, hostnames=_no_scontrol)
    assert (env.rank, env.world_size, env.master_addr, env.master_port, env.launcher) == (1, 2, "node4", 29511, "slurm")


def test_slurm_env_master_from_first_host_of_nodelist():
    seen = []

    def expand(nodelist):  # what `scontrol show hostnames node[3-4]` prints, split into lines
        seen.append(nodelist)
        return ["node3", "node4"]

    env = detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[3-4]",
                      "SLURM_JOB_ID": "41"}, hostnames=expand)
    assert seen == ["node[3-4]"] and env.master_addr == "node3" and env.master_port == 20041


def test_single_process_and_missing_rendezvous():
    assert detect_env({}).world_size == 1
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        detect_env({"RANK": "0", "WORLD_SIZE": "2"})
