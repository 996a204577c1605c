"""busbw/algbw as nccl-tests defines them for alltoall, the size ladder, the known pattern, baseline judging."""

from __future__ import annotations

import pytest
import torch

from moe_launch.health import baselines
from moe_launch.health.alltoall import (
    A2ARow,
    algbw_gbs,
    busbw_gbs,
    chunk_elems,
    count_wrong,
    format_table,
    pattern,
    size_ladder,
)


def test_bandwidth_formulas_hand_computed():
    # 1e9 B per rank in 0.5 s over 4 ranks: algbw 2 GB/s; 3 of 4 chunks cross the fabric: busbw 1.5 GB/s
    assert algbw_gbs(10**9, 0.5) == pytest.approx(2.0)
    assert busbw_gbs(10**9, 0.5, 4) == pytest.approx(1.5)
    # 2 ranks, 1 GiB in 1.628 ms (our 2xH200 measurement): 659.5 GB/s algbw, half of it busbw
    assert algbw_gbs(2**30, 1.628e-3) == pytest.approx(659.546, abs=1e-3)
    assert busbw_gbs(2**30, 1.628e-3, 2) == pytest.approx(329.773, abs=1e-3)
    # the handbook's 2-node H100 baseline (16 ranks, 8 GiB): 77.14 GB/s busbw <=> 104.4 ms per all-to-all
    assert busbw_gbs(8 * 2**30, 0.104398, 16) == pytest.approx(77.14, abs=0.01)
    assert busbw_gbs(4096, 1e-3, 1) == 0.0  # one rank: nothing crosses a link


def test_size_ladder_and_chunks():
    assert size_ladder(1024, 2**20) == [1024, 8192, 65536, 524288, 2**20]
    assert size_ladder(2**20, 2**20) == [2**20]
    assert size_ladder(1024, 8 * 2**30)[-1] == 8 * 2**30
    assert chunk_elems(4096, 4) == 256 and chunk_elems(1000, 3) == 83 and chunk_elems(4, 8) == 1


def test_pattern_and_wrong_count():
    world, n, me = 3, 50, 1
    recv = torch.stack([pattern(s, me, n, torch.device("cpu")) for s in range(world)])
    assert count_wrong(recv, me) == 0
    assert len(set(recv.flatten().tolist())) > n  # chunks from different sources differ
    recv[2, 7] += 1
    recv[0, :3] = 0
    assert count_wrong(recv, me) == 1 + int((pattern(0, me, 3, torch.device("cpu")) != 0).sum())
    # a chunk delivered to the wrong destination is caught
    assert count_wrong(torch.stack([pattern(s, 2, n, torch.device("cpu")) for s in range(world)]), me) > 0


def test_judge_against_baseline():
    rows = [A2ARow(1024, 1e-3, 1.0, 0.75, 0), A2ARow(8192, 1e-3, 8.0, 6.0, 0)]
    assert baselines.judge_alltoall(rows, None, 0.9) == ("pass", [])
    assert baselines.judge_alltoall(rows, 6.6, 0.9)[0] == "pass"  # 6.0 >= 0.9 * 6.6 = 5.94
    status, reasons = baselines.judge_alltoall(rows, 6.7, 0.9)
    assert status == "fail" and "health.alltoall.threshold=0.9" in reasons[0]
    wrong = [A2ARow(1024, 1e-3, 1.0, 0.75, 3), rows[1]]
    status, reasons = baselines.judge_alltoall(wrong, None, 0.9)
    assert status == "fail" and "3 wrong elements" in reasons[0]


def test_baseline_file_roundtrip(tmp_path):
    path = tmp_path / "b.json"
    data = baselines.load(path)
    key = baselines.A2AKey("c", 4, 8, 2**20, "nccl")
    assert str(key) == "c|nodes=4|rpn=8|bytes=1048576|nccl" and baselines.a2a_baseline(data, key) is None
    baselines.record_alltoall(data, key, A2ARow(2**20, 1e-3, 1.0, 0.875, 0), ["n1", "n2", "n3", "n4"], "r")
    baselines.save(path, data)
    again = baselines.load(path)
    assert baselines.a2a_baseline(again, key) == 0.875
    assert again["alltoall"][str(key)]["nodes"] == ["n1", "n2", "n3", "n4"]
    other = baselines.A2AKey("c", 2, 8, 2**20, "nccl")  # another node count is another baseline
    assert baselines.a2a_baseline(again, other) is None


def test_table_format():
    text = format_table([A2ARow(8589934592, 0.1044, 82.28, 77.14, 0)])
    assert text.splitlines()[0].split()[-1] == "#wrong"
    assert "8589934592" in text and "77.140" in text
