"""In-training sniff test: every `interval` steps, time a short all-to-all inside the EP group and name stragglers.

Why not just compare each rank's all-to-all time: a collective ends for everybody when the slowest member is done,
so every rank measures about the same total. What differs is *where* the time goes. Each rank times
  t_pre   its own work before the collective (a small fixed GEMM on its device; the fault-injection delay sits here)
  t_coll  its time inside all_to_all_single (waiting for late peers + the transfer itself)
The rank that arrives last waits least, so the transfer itself is about min(t_coll) over the group, and a rank's
own cost is  own = t_pre + min(t_coll).  A rank is a straggler when its own cost exceeds the mean of the OTHER ranks
by more than 10% and by more than one standard deviation of the others (leave-one-out statistics, so one outlier
cannot hide itself by inflating the spread). A slow link slows the whole group's all-to-all instead; `group_s` is
returned so the trainer can log it, and preflight isolation is what names the node behind it.

Usage in the trainer (all ranks of the EP group call it at the same step):
    sniffer = AllToAllSniffer(ep_group, cfg.health.sniff_interval, inject_delay=cfg.health.inject_delay)
    report = sniffer.maybe_sniff(step)
    if report and report.stragglers and rank == 0:
        journal_event(run_dir, "straggler", nodes=report.straggler_nodes, **report.journal_details())
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_launch.health.alltoall import chunk_elems, pattern, this_node

REL_MARGIN = 0.10  # slower than the others by more than 10% ...
SIGMA_MARGIN = 1.0  # ... and by more than one standard deviation of the others


@dataclass
class SniffReport:
    step: int
    own_s: list[float]  # per group rank
    pre_s: list[float]
    coll_s: list[float]
    nodes: list[str]
    stragglers: list[int]  # group ranks
    group_s: float  # the slowest rank's total time: what the group paid for this all-to-all

    @property
    def straggler_nodes(self) -> list[str]:
        return sorted({self.nodes[r] for r in self.stragglers})

    def journal_details(self) -> dict[str, Any]:
        d = asdict(self)
        d["straggler_nodes"] = self.straggler_nodes
        return d


def find_stragglers(own_s: list[float], rel: float = REL_MARGIN, sigmas: float = SIGMA_MARGIN) -> list[int]:
    """Pure: indices whose value exceeds the others' mean by > rel (relative) and > sigmas·pstdev(others)."""
    out = []
    for i, t in enumerate(own_s):
        others = own_s[:i] + own_s[i + 1 :]
        if not others:
            continue
        mean, sd = statistics.fmean(others), statistics.pstdev(others)
        if t > mean * (1 + rel) and t > mean + sigmas * sd:
            out.append(i)
    return out


class AllToAllSniffer:
    def __init__(self, group: Optional[dist.ProcessGroup] = None, interval: int = 0, nbytes: int = 64 * 1024,
                 gemm_size: int = 128, inject_delay: Optional[dict[str, float]] = None,
                 device: Optional[torch.device] = None):
        self.group, self.interval, self.nbytes, self.gemm_size = group, interval, nbytes, gemm_size
        self.node = this_node()
        self.delay_s = float((inject_delay or {}).get(self.node, 0.0))
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
                else torch.device("cpu")
        self.device = device
        world, me = dist.get_world_size(group), dist.get_rank(group)
        n = chunk_elems(nbytes, world)
        self.send_WN = torch.stack([pattern(me, d, n, device) for d in range(world)])
        self.recv_WN = torch.empty_like(self.send_WN)
        self.a_GG = torch.randn(gemm_size, gemm_size, device=device)

    def maybe_sniff(self, step: int) -> Optional[SniffReport]:
        if self.interval <= 0 or step % self.interval != 0:
            return None
        return self.sniff(step)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # note: a CPU-GPU sync point, only on sniff steps

    def sniff(self, step: int = 0) -> SniffReport:
        """Collective over the group: every member must call it."""
        dist.barrier(group=self.group)
        t0 = time.perf_counter()
        if self.delay_s > 0:
            time.sleep(self.delay_s)  # fault injection: this host is slow
        (self.a_GG @ self.a_GG).sum()
        self._sync()
        t1 = time.perf_counter()
        dist.all_to_all_single(self.recv_WN, self.send_WN, group=self.group)
        self._sync()
        t2 = time.perf_counter()
        world = dist.get_world_size(self.group)
        mine = torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self.group)
        nodes: list[Optional[str]] = [None] * world
        dist.all_gather_object(nodes, self.node, group=self.group)
        pre = [float(g[0]) for g in gathered]
        coll = [float(g[1]) for g in gathered]
        transfer = min(coll)
        own = [p + transfer for p in pre]
        group_s = max(p + c for p, c in zip(pre, coll))
        return SniffReport(step, own, pre, coll, [str(n) for n in nodes], find_stragglers(own), group_s)
