"""In-training sniff: straggler statistics (pure) and a real gloo EP group with one slow host."""

from __future__ import annotations

import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_launch.health.sniff import AllToAllSniffer, find_stragglers


def test_find_stragglers_rules():
    assert find_stragglers([1.0, 1.0, 1.0, 1.5]) == [3]
    assert find_stragglers([1.0, 1.02, 0.99, 1.05]) == []  # within 10%
    assert find_stragglers([0.3, 0.01]) == [0]  # two ranks: compared with the other one only
    # 12% slower but inside the spread of very noisy peers: not flagged
    assert 5 not in find_stragglers([1.0, 0.6, 1.4, 0.8, 1.2, 1.12])
    assert find_stragglers([1.0]) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["MOE_LAUNCH_NODE"] = "slowhost" if rank == 2 else f"host{rank}"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sniffer = AllToAllSniffer(None, interval=5, nbytes=4096, inject_delay={"slowhost": 0.2})
    assert sniffer.maybe_sniff(3) is None  # not a sniff step
    report = sniffer.maybe_sniff(10)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report.journal_details(), f)
    dist.destroy_process_group()


def test_slow_host_is_named(tmp_path):
    out = tmp_path / "report.json"
    mp.spawn(_worker, args=(4, _free_port(), str(out)), nprocs=4, join=True)
    report = json.loads(out.read_text())
    assert report["stragglers"] == [2] and report["straggler_nodes"] == ["slowhost"]
    assert report["step"] == 10 and report["group_s"] >= 0.2
    # everyone waited for the slow host inside the collective; its own share is what stands out
    assert min(report["coll_s"]) == report["coll_s"][2]
