"""The expert weights as FP8 GEMM operands, and their reuse while the weights stay the same.

An FP8 expert layer multiplies by each weight twice per pass, scaled per output channel of that GEMM, so every weight
is quantized in two orientations (E local experts, F expert hidden, D model dim):
  forward   x_ND @ [w_gate; w_up]^T   gate_up()  b operand [E, D, 2F], scales [E, 2F]: one GEMM for both projections
            h_NF @ w_down^T           down()     b operand [E, F, D], scales [E, D]
  backward  dy_ND @ w_down            down_t()   b operand [E, D, F], scales [E, F]
            [dg du]_N2F @ [w_gate; w_up]  gate_up_t()  b operand [E, 2F, D], scales [E, D] over both: one GEMM for
                                                        the input gradient of both projections
The quantization reads the weights in whatever dtype they are stored (fp32 masters need no bf16 copy first).

Reuse: `with reuse_weights(keep):` opens a scope in which an operand named in `keep`, once quantized, is handed to
every later call on the same weight: the trainer opens one around a step's forward and backward passes, where the
weights cannot change, so further micro-batches and recomputed forwards skip the quantization (operands_to_reuse
picks what a step would quantize more than once). An entry is used only while its weight's autograd version counter
and storage are the ones it was built from (an in-place update through torch ops re-quantizes); an update that
bypasses the version counter (a Triton kernel, `.data`) must happen outside any scope, as the optimizer's does. The
scope holds the e4m3 copies, as many bytes as the bf16 weights, until their last use: a scope told how often a step
uses each operand (`uses`, from operands_to_reuse) drops an entry at its last lookup, so the forward operands of
the last micro-batch are gone before the backward's peak (the caller's reference lives on until its GEMM is done);
without `uses`, or when a step looks an operand up fewer times than announced, entries go when the scope closes.
A lookup after an entry was dropped quantizes again: more work, never a stale operand. Outside a scope every call
quantizes afresh and nothing is kept. The open scopes are process-wide, not per thread: autograd runs a CUDA
backward on its own thread, which must see the scope the forward saw.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from moe_launch.kernels import fp8

Operand = tuple[torch.Tensor, torch.Tensor]  # (q_EKM e4m3 column-major, s_EM fp32): the b operand of a GEMM


FORWARD = ("gate_up", "down")
BACKWARD = ("down_t", "gate_up_t")


def operands_to_reuse(passes: int, forward_recomputed: bool) -> dict[str, int]:
    """The operands a step keeps, each with how often a layer looks it up per step: those it would quantize more
    than once. `passes`: forward+backward passes per step (micro-batches); `forward_recomputed`: the experts'
    forward runs again in the backward. Pure."""
    forward_uses = passes * (2 if forward_recomputed else 1)
    return {name: uses for names, uses in ((FORWARD, forward_uses), (BACKWARD, passes)) if uses > 1
            for name in names}


def _nbytes(op: Operand) -> int:
    return sum(t.untyped_storage().nbytes() for t in op)


@dataclass
class ReuseScope:
    """The operands quantized in one scope, by (orientation, weights' ids); hits / misses count lookups of the kept
    orientations; held_bytes / peak_bytes the e4m3 operands and scales the scope holds now / held at most."""
    keep: tuple[str, ...]
    uses: dict[str, int] = field(default_factory=dict)  # lookups per entry after which it is dropped
    entries: dict[tuple, tuple[tuple, Operand, tuple]] = field(default_factory=dict)
    looked_up: dict[tuple, int] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    held_bytes: int = 0
    peak_bytes: int = 0

    def store(self, key: tuple, entry: tuple[tuple, Operand, tuple]) -> None:
        self.drop(key)
        self.entries[key] = entry
        self.held_bytes += _nbytes(entry[1])
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def drop(self, key: tuple) -> None:
        old = self.entries.pop(key, None)
        if old is not None:
            self.held_bytes -= _nbytes(old[1])

    def count_use(self, key: tuple) -> None:
        self.looked_up[key] = self.looked_up.get(key, 0) + 1
        if self.looked_up[key] >= self.uses.get(key[0], 0) > 0:
            self.drop(key)


_SCOPES: list[ReuseScope] = []


@contextlib.contextmanager
def reuse_weights(keep: tuple[str, ...] | dict[str, int] = FORWARD + BACKWARD) -> Iterator[ReuseScope | None]:
    """Reuse the operands named in `keep` (see the module docstring); keep=(): no scope. A dict (operands_to_reuse's
    answer) also says after how many lookups per step each is dropped; a tuple keeps them until the block ends."""
    if not keep:
        yield None
        return
    unknown = set(keep) - set(FORWARD + BACKWARD)
    if unknown:
        raise ValueError(f"unknown FP8 weight operands {sorted(unknown)}; known: {FORWARD + BACKWARD}")
    scope = ReuseScope(tuple(keep), dict(keep) if isinstance(keep, dict) else {})
    _SCOPES.append(scope)
    try:
        yield scope
    finally:
        _SCOPES.remove(scope)
        for key in list(scope.entries):
            scope.drop(key)


def _stamp(ws: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype) for w in ws)


def _cached(name: str, ws: tuple[torch.Tensor, ...], build: Callable[[], Operand]) -> Operand:
    if not _SCOPES or name not in _SCOPES[-1].keep:
        return build()
    scope = _SCOPES[-1]
    key = (name, *(id(w) for w in ws))
    stamp = _stamp(ws)
    hit = scope.entries.get(key)
    if hit is not None and hit[0] == stamp:
        scope.hits += 1
        op = hit[1]
    else:
        scope.misses += 1
        op = build()
        scope.store(key, (stamp, op, ws))  # holding the weights keeps their ids from being reused by new tensors
    scope.count_use(key)
    return op


class ExpertOperands:
    """The FP8 operands of one layer call's expert weights, each quantized on first use (inside a reuse scope: at
    most once per scope)."""

    def __init__(self, w_gate_EFD: torch.Tensor, w_up_EFD: torch.Tensor, w_down_EDF: torch.Tensor):
        self.w_gate_EFD, self.w_up_EFD, self.w_down_EDF = w_gate_EFD, w_up_EFD, w_down_EDF

    def gate_up(self) -> Operand:
        def build() -> Operand:
            E, Fh, D = self.w_gate_EFD.shape
            q_E2FD = torch.empty(E, 2 * Fh, D, dtype=fp8.E4M3, device=self.w_gate_EFD.device)
            s_E2F = torch.empty(E, 2 * Fh, dtype=torch.float32, device=self.w_gate_EFD.device)
            fp8.quantize_rows(self.w_gate_EFD, out=(q_E2FD[:, :Fh], s_E2F[:, :Fh]))
            fp8.quantize_rows(self.w_up_EFD, out=(q_E2FD[:, Fh:], s_E2F[:, Fh:]))
            return q_E2FD.transpose(1, 2), s_E2F
        return _cached("gate_up", (self.w_gate_EFD, self.w_up_EFD), build)

    def down(self) -> Operand:
        return _cached("down", (self.w_down_EDF,), lambda: fp8.quantize_operand(self.w_down_EDF.transpose(1, 2)))

    def down_t(self) -> Operand:
        return _cached("down_t", (self.w_down_EDF,), lambda: fp8.quantize_operand(self.w_down_EDF))

    def gate_up_t(self) -> Operand:
        # channel d of [w_gate; w_up] runs over both weights' F rows: one scale for both
        return _cached("gate_up_t", (self.w_gate_EFD, self.w_up_EFD),
                       lambda: fp8.quantize_operand(self.w_gate_EFD, tail=self.w_up_EFD))
