"""Point-to-point exchange of one round (trainer/pipeline/plan.py) over the pp process group.

`batch_isend_irecv` posts all sends and receives of a round as one batch. NCCL coalesces them into one group call
(so a send and a receive between the same two ranks cannot block each other) and returns one work for the batch;
gloo does not coalesce: it posts each op as a separate isend / irecv (already asynchronous) and returns one work per
op. Either way the runtime waits for every work of the batch before using any tensor received in it, so the two
behaviours need no separate code. Tags stay 0: the order of the messages inside a round is canonical on both sides
(sorted), which is what both backends match on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class Pending:
    """The works of one posted round; `wait()` once, then the received tensors are valid."""

    works: list[Any] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)  # kept alive until the sends / receives complete
    done: bool = False

    def wait(self) -> None:
        if not self.done:
            for w in self.works:
                w.wait()  # note: on GPU this makes the current stream wait; on CPU it blocks the host
            self.done = True
            self.works, self.tensors = [], []


def post_round(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
               group: Optional[Any]) -> Pending:
    """Post isends of (tensor, peer global rank) and irecvs into preallocated tensors, in the given order."""
    payload = [(t.contiguous(), peer) for t, peer in sends]
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in payload]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    if not ops:
        return Pending(done=True)
    return Pending(works=list(dist.batch_isend_irecv(ops)), tensors=[t for t, _ in payload] + [t for t, _ in recvs])
