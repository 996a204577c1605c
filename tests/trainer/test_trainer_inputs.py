"""Bad input through the real entry point: exit code 2 (EXIT_CONFIG) and a message naming the key and the fix."""

import numpy as np
from omegaconf import OmegaConf
from trainer_harness import tiny_cfg, write_run

from moe_launch.rundir import EXIT_CONFIG
from moe_launch.trainer.__main__ import main
from moe_launch.trainer.data.shards import ShardIndex, write_index, write_shard


def _tiny_dataset(path, rows_NL: np.ndarray, seq_len: int = 32) -> str:
    path.mkdir(parents=True)
    write_shard(path, 0, rows_NL)
    write_index(path, ShardIndex(seq_len=seq_len, dtype="uint16", vocab_size=512, eos_id=0, max_token_id=511,
                                 shards=[{"file": "shard-00000.npy", "count": 16}], tokenizer="test", seed=0,
                                 shard_size=16))
    return str(path)


def _run(tmp_path, cfg, capsys) -> tuple[int, str]:
    rd = write_run(tmp_path / "run", cfg)
    code = main(["--run-dir", str(rd.root)])
    return code, capsys.readouterr().err


def test_missing_data_path(tmp_path, capsys, data_cache):
    cfg = tiny_cfg(data_cache)
    cfg.data.path = str(tmp_path / "no-such-data")
    code, err = _run(tmp_path, cfg, capsys)
    assert code == EXIT_CONFIG and "data.path" in err and "does not exist" in err and "moe-data prepare" in err


def test_shard_of_wrong_dtype(tmp_path, capsys, data_cache):
    cfg = tiny_cfg(data_cache)
    cfg.data.path = _tiny_dataset(tmp_path / "d", np.zeros((16, 33), dtype=np.float32))
    code, err = _run(tmp_path, cfg, capsys)
    assert code == EXIT_CONFIG and "dtype float32" in err and "uint16" in err


def test_shard_of_wrong_shape(tmp_path, capsys, data_cache):
    cfg = tiny_cfg(data_cache)
    cfg.data.path = _tiny_dataset(tmp_path / "d", np.zeros((16, 20), dtype=np.uint16))
    code, err = _run(tmp_path, cfg, capsys)
    assert code == EXIT_CONFIG and "shard" in err and "(16, 20)" in err


def test_context_longer_than_the_data(tmp_path, capsys, data_cache):
    cfg = tiny_cfg(data_cache)
    cfg.data.path = _tiny_dataset(tmp_path / "d", np.zeros((16, 17), dtype=np.uint16), seq_len=16)
    code, err = _run(tmp_path, cfg, capsys)
    assert code == EXIT_CONFIG and "train.seq_len=32" in err


def test_seq_len_above_model_max(tmp_path, capsys, data_cache):
    rd = write_run(tmp_path / "run", tiny_cfg(data_cache))
    raw = OmegaConf.load(rd.config)
    raw.train.seq_len = 64  # model.max_seq_len is 32
    OmegaConf.save(raw, rd.config)
    code = main(["--run-dir", str(rd.root)])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG and "train.seq_len" in err and "max_seq_len=32" in err


def test_missing_config(tmp_path, capsys):
    code = main(["--run-dir", str(tmp_path / "nowhere")])
    assert code == EXIT_CONFIG and "config.yaml" in capsys.readouterr().err


def test_fp8_experts_off_hopper(tmp_path, capsys, data_cache):
    """On the CPU (or any non-sm90 device) model.moe.precision=fp8 is refused before the model is built."""
    cfg = tiny_cfg(data_cache)
    cfg.model.moe.precision = "fp8"
    code, err = _run(tmp_path, cfg, capsys)
    assert code == EXIT_CONFIG and "model.moe.precision" in err and "precision=bf16" in err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
