"""Segment digests of checkpoint files (trainer/checkpoint/digest.py): the same digests whatever the write chunking,
a flipped byte found in its segment by the parallel check, whole-file entries of older checkpoints still checked."""

import os
import random

import pytest

from moe_launch.trainer.checkpoint.digest import DIGEST, SegmentedDigest, new_hasher, verify_files

SEG = 4096


def _entry(data: bytes, chunks: list[int]) -> dict:
    d, pos = SegmentedDigest(DIGEST, SEG), 0
    for n in chunks:
        d.update(data[pos : pos + n])
        pos += n
    d.update(data[pos:])
    return {**d.entry(), "bytes": len(data)}


@pytest.mark.parametrize("size", [0, 1, SEG - 1, SEG, SEG + 1, 5 * SEG + 123])
def test_segment_digests_do_not_depend_on_how_the_bytes_were_chunked(size):
    data = random.Random(size).randbytes(size)
    rng = random.Random(1)
    chunkings = [[], [size], [rng.randrange(1, 3 * SEG) for _ in range(8)], [1] * min(size, 50)]
    entries = [_entry(data, c) for c in chunkings]
    assert all(e == entries[0] for e in entries)
    assert len(entries[0][f"{DIGEST}_segments"]) == max(1, -(-size // SEG))


def test_parallel_check_finds_a_flipped_byte_in_its_segment(tmp_path):
    data = random.Random(0).randbytes(7 * SEG + 5)
    entry = _entry(data, [1000, 70000])
    path = tmp_path / "f.pt"
    path.write_bytes(data)
    assert verify_files([(path, entry)], readers=4) == (True, "ok")
    damaged = bytearray(data)
    damaged[3 * SEG + 17] ^= 0x01
    path.write_bytes(bytes(damaged))
    ok, reason = verify_files([(path, entry)], readers=4)
    assert not ok and "mismatch" in reason and f"bytes {3 * SEG}..{4 * SEG}" in reason


def test_whole_file_digests_and_sizes(tmp_path):
    data = os.urandom(3 * SEG)
    h = new_hasher(DIGEST)
    h.update(data)
    path = tmp_path / "old.pt"
    path.write_bytes(data)
    legacy = {DIGEST: h.hexdigest(), "bytes": len(data)}  # a checkpoint written before segment digests
    assert verify_files([(path, legacy)]) == (True, "ok")
    path.write_bytes(data[:-1])
    ok, reason = verify_files([(path, legacy)])
    assert not ok and "truncated" in reason
    ok, reason = verify_files([(tmp_path / "gone.pt", legacy)])
    assert not ok and "missing" in reason
