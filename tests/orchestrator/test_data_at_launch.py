"""Bad data is refused at plan time (and in --dry-run), naming data.path, before any run directory or allocation;
a relative data.path means the launch directory; a trainer that still exits 2 gets its own words into the stop
reason and onto the terminal."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from e2e_util import MOE_LAUNCH
from omegaconf import OmegaConf

from moe_launch.conf.schema import DataConfig
from moe_launch.errors import DataError
from moe_launch.orchestrator.step_log import last_trainer_message, trainer_message
from moe_launch.trainer.data import megatron, shards
from moe_launch.trainer.data.check import check_data

FAKE = str(Path(__file__).parent / "fake_trainer.py")


def make_dataset(path: Path, seq_len: int = 64, rows: int = 8, max_id: int = 100) -> Path:
    path.mkdir(parents=True)
    rows_NL = np.random.default_rng(0).integers(0, max_id + 1, size=(rows, seq_len + 1)).astype(np.uint16)
    shards.write_shard(path, 0, rows_NL)
    shards.write_index(path, shards.ShardIndex(seq_len=seq_len, dtype="uint16", vocab_size=4096, eos_id=0,
                                               max_token_id=max_id, shards=[{"file": shards.shard_name(0),
                                                                             "count": rows}],
                                               tokenizer="test", seed=0, shard_size=rows))
    return path


def cli(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([MOE_LAUNCH, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    return proc, time.perf_counter() - t0


def test_check_data_names_data_path_for_every_problem(tmp_path):
    good = make_dataset(tmp_path / "good")
    assert check_data(DataConfig(path="good"), 32, 4096, tmp_path).path == str(good)
    with pytest.raises(DataError, match="data.path=.*nowhere does not exist"):
        check_data(DataConfig(path=str(tmp_path / "nowhere")), 32, 4096, tmp_path)
    with pytest.raises(DataError, match="data.path=.*train.seq_len=128 is longer"):
        check_data(DataConfig(path="good"), 128, 4096, tmp_path)
    with pytest.raises(DataError, match="data.path=.*token id 100 but model.vocab_size=50"):
        check_data(DataConfig(path="good"), 32, 50, tmp_path)
    (good / "index.json").write_text("{not json")
    with pytest.raises(DataError, match="data.path=.*index.json is not valid JSON"):
        check_data(DataConfig(path="good"), 32, 4096, tmp_path)
    truncated = make_dataset(tmp_path / "trunc")
    shard = truncated / shards.shard_name(0)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match="data.path=.*shard-00000.npy is not a readable .npy"):
        check_data(DataConfig(path=str(truncated)), 32, 4096, tmp_path)


def test_check_data_reads_megatron_headers(tmp_path):
    megatron.write_indexed_dataset(tmp_path / "ds", [np.arange(50) % 90 for _ in range(4)])
    cfg = DataConfig(path="ds", format="megatron")
    assert check_data(cfg, 32, 4096, tmp_path).path == str(tmp_path / "ds")
    with pytest.raises(DataError, match="data.path=.*model.vocab_size=40"):
        check_data(cfg, 32, 40, tmp_path)
    (tmp_path / "ds.idx").write_bytes((tmp_path / "ds.idx").read_bytes()[:20])
    with pytest.raises(DataError, match="data.path=.*truncated"):
        check_data(cfg, 32, 4096, tmp_path)


@pytest.mark.parametrize("flag", ["--dry-run", "train.steps=3"])
def test_bad_data_is_refused_before_submission(tmp_path, flag):
    proc, seconds = cli(tmp_path, flag, "run.name=bad", "data.path=/nonexistent/data")
    assert proc.returncode == 2, proc.stderr
    assert "refused before submission: data.path=/nonexistent/data does not exist" in proc.stderr
    assert not (tmp_path / "runs" / "bad").exists()  # nothing written, nothing started
    make_dataset(tmp_path / "trunc")
    shard = tmp_path / "trunc" / shards.shard_name(0)
    shard.write_bytes(shard.read_bytes()[:-100])
    proc, _ = cli(tmp_path, flag, "run.name=bad", "data.path=trunc", "train.seq_len=32")
    assert proc.returncode == 2 and f"data.path={tmp_path / 'trunc'}" in proc.stderr and "shard-00000" in proc.stderr
    print(f"\nrefused in {seconds:.2f} s (whole CLI, Python start included): {proc.stderr.strip()[:200]}")


def test_relative_data_path_means_the_launch_directory(tmp_path):
    make_dataset(tmp_path / "mydata")
    proc, _ = cli(tmp_path, "run.name=rel", "data.path=mydata", "train.seq_len=32", "train.steps=2",
                  f"supervisor.trainer_command=[{sys.executable},{FAKE}]", "health.preflight=false",
                  "supervisor.poll_s=0.1")
    assert proc.returncode == 0, proc.stderr
    written = OmegaConf.load(tmp_path / "runs" / "rel" / "config.yaml")
    assert written.data.path == str(tmp_path / "mydata")  # the trainer runs in the run directory, not here


REFUSING_TRAINER = ("import sys; print('loading data ...'); "
                    "print('[trainer] DataError: shard 7 holds token id 70000 but model.vocab_size=4096', "
                    "file=sys.stderr); sys.exit(2)")


def test_trainer_exit_2_carries_its_own_message(tmp_path):
    proc, _ = cli(tmp_path, "run.name=refuse", "train.steps=2", "health.preflight=false", "supervisor.poll_s=0.1",
                  f"supervisor.trainer_command=[{sys.executable},-c,{json.dumps(REFUSING_TRAINER)}]")
    assert proc.returncode == 1
    said = "shard 7 holds token id 70000 but model.vocab_size=4096"
    summary = json.loads((tmp_path / "runs" / "refuse" / "summary.json").read_text())
    assert summary["status"] == "failed" and said in summary["reason"] and "trainer exit 2" in summary["reason"]
    assert said in proc.stderr  # the terminal's last word


def test_last_trainer_message_reads_the_newest_mark(tmp_path):
    assert last_trainer_message("0: [trainer] first\n1: noise\n1: [trainer] CheckpointError: gone\n") == \
        "CheckpointError: gone"
    assert trainer_message(tmp_path) == ""
