"""TokenLoader: step-deterministic batches, DP slicing, epochs, cropping, state, and clear errors on bad data."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from data_helpers import TINY_VOCAB

from moe_launch.errors import DataError
from moe_launch.trainer.data.loader import TokenLoader
from moe_launch.trainer.data.permutation import permute
from moe_launch.trainer.data.shards import read_index


def _loader(path, **kw):
    args = dict(fmt="npy", seq_len=32, global_batch=8, data_rank=0, data_size=1, seed=7, vocab_size=TINY_VOCAB)
    args.update(kw)
    return TokenLoader(path, **args)


def _disk_rows(path):
    return np.concatenate([np.load(path / s["file"]) for s in read_index(path).shards])


def test_first_epoch_reads_disk_order(small_dataset):
    loader = _loader(small_dataset)
    rows = _disk_rows(small_dataset)
    batch = loader.get(3)
    assert batch.dtype == torch.int64 and batch.shape == (8, 33)
    assert np.array_equal(batch.numpy(), rows[24:32])


@pytest.mark.parametrize("data_size", [2, 4])
def test_dp_slices_concatenate_to_single_rank_batch(small_dataset, data_size):
    single = _loader(small_dataset)
    ranks = [_loader(small_dataset, data_rank=r, data_size=data_size) for r in range(data_size)]
    n = single.n_instances
    # steps in the first epoch, across the epoch boundary, and in later epochs
    for step in (0, 5, n // 8 - 1, n // 8, n // 8 + 1, 3 * n // 8 + 2):
        parts = [loader.get(step) for loader in ranks]
        assert all(p.shape == (8 // data_size, 33) for p in parts)
        assert torch.equal(torch.cat(parts), single.get(step))


def test_get_is_a_pure_function_of_step(small_dataset):
    a, b = _loader(small_dataset), _loader(small_dataset)
    n = a.n_instances
    steps = [0, 1, n // 8 + 3, 7, 2 * n // 8 + 1, 1]
    first = [a.get(s) for s in steps]
    second = [b.get(s) for s in reversed(steps)][::-1]  # another order, another object
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    other_seed = _loader(small_dataset, seed=8)
    later = n // 8 + 3  # epoch 1: the order depends on the seed
    assert not torch.equal(a.get(later), other_seed.get(later))
    assert torch.equal(a.get(0), other_seed.get(0))  # epoch 0 is the prepared order


def test_each_epoch_covers_every_instance_once(small_dataset):
    loader = _loader(small_dataset, global_batch=1)
    n = loader.n_instances
    for epoch in (0, 1, 2):
        ids = np.concatenate([loader.instance_ids(s) for s in range(epoch * n, (epoch + 1) * n)])
        assert np.array_equal(np.sort(ids), np.arange(n))
    e1 = np.concatenate([loader.instance_ids(s) for s in range(n, 2 * n)])
    e2 = np.concatenate([loader.instance_ids(s) for s in range(2 * n, 3 * n)])
    assert not np.array_equal(e1, e2)
    assert np.array_equal(e1, permute(np.arange(n), n, (7, 1)))


def test_crop_to_shorter_context(small_dataset):
    full, short = _loader(small_dataset), _loader(small_dataset, seq_len=16)
    assert torch.equal(short.get(4), full.get(4)[:, :17])


def test_state_dict_round_trip_and_mismatch(small_dataset):
    loader = _loader(small_dataset)
    loader.get(9)
    state = loader.state_dict()
    assert state["position"] == 80 and state["seed"] == 7 and state["epoch"] == 80 // loader.n_instances
    resumed = _loader(small_dataset)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON/torch.save round trip
    assert resumed.next_step == 10
    assert torch.equal(resumed.get(resumed.next_step), loader.get(10))
    with pytest.raises(DataError, match="train.seed"):
        _loader(small_dataset, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="global_batch"):
        _loader(small_dataset, global_batch=4).load_state_dict(state)


def test_missing_path_and_index(tmp_path):
    with pytest.raises(DataError, match=r"data\.path=.*does not exist.*moe-data prepare"):
        _loader(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no index\.json.*moe-data prepare"):
        _loader(tmp_path / "empty")


def _copy(small_dataset, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(small_dataset, target)
    return target


def test_shard_with_wrong_dtype(small_dataset, tmp_path):
    path = _copy(small_dataset, tmp_path)
    shard = path / "shard-00001.npy"
    np.save(shard, np.load(shard).astype(np.int32))
    with pytest.raises(DataError, match=r"shard-00001\.npy has dtype int32, but index\.json says uint16"):
        _loader(path)


def test_shard_with_wrong_shape(small_dataset, tmp_path):
    path = _copy(small_dataset, tmp_path)
    shard = path / "shard-00000.npy"
    np.save(shard, np.load(shard)[:, :20])
    with pytest.raises(DataError, match=r"shard-00000\.npy has shape \(50, 20\)"):
        _loader(path)
    np.save(shard, np.zeros((3, 33), dtype=np.uint16))
    with pytest.raises(DataError, match=r"shape \(3, 33\)"):
        _loader(path)


def test_context_longer_than_dataset(small_dataset):
    with pytest.raises(DataError, match=r"train\.seq_len=64 .*moe-data prepare --seq-len 64"):
        _loader(small_dataset, seq_len=64)


def test_token_ids_beyond_model_vocab(small_dataset, tmp_path):
    with pytest.raises(DataError, match=r"model\.vocab_size=100.*at least 320"):
        _loader(small_dataset, vocab_size=100)
    # a shard whose ids exceed what its index claims is caught when the batch is read
    path = _copy(small_dataset, tmp_path)
    shard = path / "shard-00000.npy"
    rows = np.load(shard)
    rows[2, 5] = TINY_VOCAB + 7
    np.save(shard, rows)
    loader = _loader(path, global_batch=4)
    with pytest.raises(DataError, match=r"step 0 reads token id 327.*model\.vocab_size=320"):
        loader.get(0)


def test_batch_must_split_over_ranks(small_dataset):
    with pytest.raises(DataError, match="train.global_batch_size=6"):
        _loader(small_dataset, global_batch=6, data_size=4)
