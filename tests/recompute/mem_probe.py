"""Two CPU memory probes for activations.

`LiveBytes` is a dispatch mode that sees every tensor an operator creates (forward, backward, recomputation) and
tracks which of their storages are still alive after each operator: `peak` is the most bytes alive at once. Tensors
that existed before the mode was entered (parameters, inputs) are not counted, so the peak is activations +
gradients + temporaries of the step.
`saved_bytes` counts what autograd saves for backward outside recomputed regions (distinct storages).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        return out


def peak_live_bytes(fn: Callable[[], Any]) -> int:
    with LiveBytes() as probe:
        fn()
    return probe.peak


def saved_bytes(fn: Callable[[], Any]) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
