"""The entry point under srun on the local Slurm cluster: ranks from SLURM_PROCID / SLURM_NTASKS, the master from
`scontrol show hostnames $SLURM_JOB_NODELIST` (no MASTER_ADDR given), one rank per node."""

import json
import os
import subprocess
import sys

import pytest
from trainer_harness import REPO, tiny_cfg, write_run

from moe_launch.rundir import read_jsonl


@pytest.mark.slurm
def test_srun_two_nodes_without_master_addr(tmp_path, data_cache, slurm_cluster):
    rd = write_run(tmp_path / "run", tiny_cfg(data_cache, dp=2, steps=3, ckpt_interval=3))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(["srun", "-N2", "-n2", "--time=5", sys.executable, "-m", "moe_launch.trainer",
                           "--run-dir", str(rd.root)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [m["step"] for m in read_jsonl(rd.metrics)] == [1, 2, 3]
    beats = [json.loads((rd.heartbeat / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(b["step"] == 3 for b in beats)
    assert len({b["host"] for b in beats}) == 2 and {b["host"] for b in beats} <= set(slurm_cluster.nodes)
