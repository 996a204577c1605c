"""Host snapshots of training state: reusable host buffers (pinned when the state lives on a GPU), filled by
non-blocking copies on a side stream.

`HostSnapshot.capture(tree)` takes a nested dict / list / tuple whose leaves are tensors (on any device) or plain
values, and returns the same tree with every tensor replaced by its host buffer. The buffers are allocated on the
first capture and reused by every later one (keyed by the leaf's path in the tree; a changed shape or dtype
reallocates that leaf only), so a checkpoint costs no allocation on the GPU and no repeated pinning on the host.

Ordering on CUDA. The copies are queued on a side stream after everything the compute stream has queued so far
(the optimizer step that produced the state), so the host returns at once and the next forward/backward overlaps
them; only the next update may not start before they finish, which `fence()` enforces on the GPU (no host wait).
The host buffers are valid after `wait()` (a host wait on the copy's event: call it from the thread that reads
them). On the CPU `capture` copies synchronously and `wait` / `fence` are free.

A snapshot is overwritten by the next `capture`: whoever reads it (the background writer of
checkpoint/persist.py, or a restore from host memory) must be done before that, which `AsyncCheckpointer`
guarantees by capturing only when no persist is in flight.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch


class HostSnapshot:
    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._scratch: dict[str, torch.Tensor] = {}  # plain host buffers the writer derives file contents in
        self._stream = torch.cuda.Stream(device) if self.pinned else None
        self._done: Optional[torch.cuda.Event] = None
        self.tree: Any = None  # the latest captured tree (host tensors), valid after wait()
        self._reserving: Optional[threading.Thread] = None
        self.step: Optional[int] = None  # the step that tree belongs to

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers (pinned when `pinned`)."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._scratch.values())

    def scratch(self, key: str, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A reusable plain host buffer (not pinned: only the CPU reads and writes it)."""
        buf = self._scratch.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = torch.empty(shape, dtype=dtype)
            self._scratch[key] = buf
        return buf

    def reserve(self, tree: Any) -> None:
        """Allocate (and pin) the buffers `capture(tree)` will use, in a background thread: pinning tens of GB
        takes seconds, which the first checkpoint would otherwise stall for. `capture` waits for it."""
        self._reserving = threading.Thread(target=self._allocate, args=(tree, ""), name="pin-host-buffers",
                                           daemon=True)
        self._reserving.start()

    def _allocate(self, node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            self._buffer(path, node)
        elif isinstance(node, dict):
            for k, v in node.items():
                self._allocate(v, f"{path}/{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                self._allocate(v, f"{path}/{i}")

    def capture(self, tree: Any, step: int) -> Any:
        """Queue copies of every tensor leaf of `tree` into this snapshot's buffers; returns the host tree."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host = self._copy(tree, "")
            self._done = torch.cuda.Event()
            self._done.record(self._stream)
        else:
            host = self._copy(tree, "")
        self.tree, self.step = host, step
        return host

    def wait(self) -> None:
        """Block this thread until the host buffers hold the captured values."""
        if self._done is not None:
            self._done.synchronize()

    def fence(self) -> None:
        """Make the compute stream wait for the copies (before anything overwrites the captured device tensors)."""
        if self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)

    def _copy(self, node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            return self._buffer(path, node).copy_(node.detach(), non_blocking=self.pinned)
        if isinstance(node, dict):
            return {k: self._copy(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(self._copy(v, f"{path}/{i}") for i, v in enumerate(node))
        return node

    def _buffer(self, path: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned)
            self._buffers[path] = buf
        return buf
