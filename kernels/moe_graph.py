"""CUDA graphs of the expert stage, for layer calls whose kernels take less time than the host needs to queue them.

At a few thousand tokens per layer call the expert stage's ~45 kernels do about 1.4 ms of work (OLMoE dims, 1k
tokens) while the host spends 2.7-3.5 ms queueing them: torch's per-op dispatch, Triton's launcher, the autograd
engine (benchmarks/RESULTS.md). `ExpertGraphs` captures a layer's forward and backward once per input signature and
then replays them: one launch each, beside the copies of the inputs into the graphs' buffers.

    graphs = ExpertGraphs()                      one per layer: its graphs read that layer's weights by address
    graphs = ExpertGraphs(max_flops=AUTO_MAX_FLOPS)   the same, for small calls only (model.moe.cuda_graph=auto)
    fast_experts(..., graphs=graphs)             graphed where it can be, eager otherwise; the same kernels either way

When a call runs eager instead is `graph_action`, a pure function of what the call looks like (and before it, in
fast_experts: expert weights cast for the call under autocast, new tensors every time):
  - a call with more expert FLOPs than max_flops (when set): the device is busy longer than the host needs to queue
    the kernels, so a graph only adds its input copies and holds memory;
  - not on CUDA, FP8 (its weight operands come from a per-step reuse scope that a graph would freeze), no gradient
    wanted (evaluation has nothing to save, and nothing to gain from a second code path), inside torch.compile or
    inside another stream capture, or under saved-tensor hooks (activation checkpointing, as train.recompute and the
    routing-skew guard use it, and offloading): the hooks must see the saved tensors, which a graph keeps itself;
  - the first call of a signature: it compiles the Triton kernels and sizes the allocator; the second captures;
  - every graph of the signature holds the saved state of a forward whose backward has not run, and the layer holds
    `max_graphs` graphs already. A graph has one set of saved buffers, so several micro-batches in flight (a 1F1B
    pipeline stage keeps up to pp of them) take one graph each, captured as they are first needed;
  - a new signature when the layer holds `max_graphs` graphs: shapes that change from step to step (an all-to-all
    dispatcher's received token counts) would otherwise capture at every step. Eager from then on, said once.
A signature is what a graph bakes in: the input shapes and dtypes, the weights' and gradient buffers' addresses
(read and written in place by the replay), the expert range and GEMM path, and which gradients are wanted.

Memory: each signature's graphs own a private pool holding the forward's saved tensors and both passes' temporaries
for as long as the ExpertGraphs lives, where eager calls share the caching allocator. At 1k and 2k tokens per call
that raised the 16-layer OLMoE trainer's peak by 0.2 and 0.5 GiB; the pools grow with the tokens per call, to
gigabytes per layer at tens of thousands, where graphs win nothing anyway.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from moe_launch.kernels.moe import _FastExperts, experts_backward, experts_forward, grad_buffers

LOG = logging.getLogger(__name__)

EAGER, WARM, CAPTURE, REPLAY = "eager", "warm", "capture", "replay"


@dataclass(frozen=True)
class CallShape:
    """What decides whether one call can run graphed (every field a plain value: graph_action is pure)."""
    on_cuda: bool
    precision: str
    grad_wanted: bool
    compiling: bool
    capturing: bool
    saved_tensor_hooks: bool
    flops: float = 0.0  # the call's expert GEMM FLOPs, forward and backward (expert_flops)


# model.moe.cuda_graph=auto graphs calls up to this many expert FLOPs (forward + backward). On the H200 the stage's
# ~45 launches take the host about 2.7 ms to queue, and at OLMoE dims the graphs gained 1.66x at 1k tokens per call
# (0.31 TFLOP), 1.12x at 2k (0.62) and nothing from 3k (0.93) on (benchmarks/RESULTS.md, the expert stage replayed from
# CUDA graphs; rechecked with fewer eager launches, "whether auto should graph calls of 3k-6k tokens": within 5% of
# eager either way): below this the device would wait for the host.
AUTO_MAX_FLOPS = 0.8e12


def expert_flops(tokens: int, top_k: int, d_model: int, d_ff: int) -> float:
    """Forward + backward FLOPs of the expert GEMMs for tokens x top_k rows: three GEMMs of 2*D*F per row, each run
    three times (forward, activation gradient, weight gradient). With expert parallelism a rank gets a share of the
    rows; this counts them all, so it errs towards eager."""
    return 18.0 * tokens * top_k * d_model * d_ff


def graph_action(call: CallShape, held: bool, free: bool, seen: int, graphs: int, max_graphs: int,
                 max_flops: float | None = None) -> str:
    """EAGER (run the eager Function), WARM (eager, and count the signature), CAPTURE (capture a graph, then replay it)
    or REPLAY. held: graphs of this signature exist; free: one of them holds no forward whose backward is still to
    run; seen: eager calls of this signature so far; graphs: graphs this layer holds, of every signature; max_flops:
    the largest call worth a graph (None: any)."""
    if (not call.on_cuda or call.precision != "bf16" or not call.grad_wanted or call.compiling or call.capturing
            or call.saved_tensor_hooks or (max_flops is not None and call.flops > max_flops)):
        return EAGER
    if held and free:
        return REPLAY
    if graphs >= max_graphs:
        return EAGER
    return WARM if not held and seen < 1 else CAPTURE


class _Lease:
    """Held by one graphed call's autograd node: the generation of the forward whose saved state it needs."""
    __slots__ = ("gen", "__weakref__")

    def __init__(self, gen: int):
        self.gen = gen


class _Captured:
    """One forward and one backward graph of a signature, their static inputs and outputs, and whether a forward
    whose backward is still to run holds the saved state."""

    def __init__(self, x_TD, w_TK, idx_TK, weights, e_start: int, gemm_impl: str, need: tuple[bool, ...], into):
        self.x_TD, self.w_TK, self.idx_TK = x_TD.detach().clone(), w_TK.detach().clone(), idx_TK.clone()
        self.dy_TD = torch.zeros_like(self.x_TD)
        self.need, self.into_ptrs = need, _ptrs(into)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: the trainer's checkpoint writer may copy from the GPU on its own thread meanwhile
        with torch.no_grad():
            with torch.cuda.graph(self.fwd, capture_error_mode="thread_local"):
                self.y_TD, self.saved = experts_forward(self.x_TD, self.w_TK, *weights, self.idx_TK, e_start,
                                                        gemm_impl, "bf16")
            with torch.cuda.graph(self.bwd, pool=self.fwd.pool(), capture_error_mode="thread_local"):
                self.grads = experts_backward(self.saved, self.dy_TD, need, into)
        self.gen, self.busy = 0, False

    def forward(self, x_TD, w_TK, idx_TK) -> tuple[torch.Tensor, _Lease]:
        self.x_TD.copy_(x_TD)
        self.w_TK.copy_(w_TK)
        self.idx_TK.copy_(idx_TK)
        self.fwd.replay()
        self.gen += 1
        self.busy = True
        lease = _Lease(self.gen)
        weakref.finalize(lease, self._release, self.gen)  # a forward whose backward never runs frees the graph too
        return self.y_TD.clone(), lease  # the static output is overwritten by the next replay

    def backward(self, lease: _Lease, dy_TD, into) -> tuple:
        if lease.gen != self.gen:
            raise RuntimeError(
                "the CUDA-graphed expert layer ran another forward before this backward (backward twice with "
                "retain_graph=True around a new forward?), so the saved state this backward needs is gone; "
                "set model.moe.cuda_graph=false (or call fast_experts without graphs=) for that use")
        self.dy_TD.copy_(dy_TD)
        if _ptrs(into) == self.into_ptrs:
            self.bwd.replay()
            grads = self.grads
        else:  # the gradient buffers moved since the capture (zero_grad(set_to_none)): the same kernels, eager
            grads = experts_backward(self.saved, self.dy_TD, self.need, into)
        self._release(lease.gen)
        dx_TD, dw_TK, *dw = grads
        # dx and dw_TK flow on through autograd, which may keep them: copies. A weight gradient is added to .grad
        # (or copied into it: AccumulateGrad never adopts a tensor someone else holds) before the next replay
        return (None if dx_TD is None else dx_TD.clone(), None if dw_TK is None else dw_TK.clone(), *dw)

    def _release(self, gen: int) -> None:
        if self.gen == gen:
            self.busy = False


def saved_tensor_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _ptrs(buffers) -> tuple[int, ...]:
    return tuple(0 if b is None else b.data_ptr() for b in buffers)


class _GraphedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, idx_TK, captured: _Captured, fuse_grads: bool):
        y_TD, ctx.lease = captured.forward(x_TD, w_TK, idx_TK)
        ctx.captured, ctx.fuse_grads, ctx.weights = captured, fuse_grads, (w_gate_EFD, w_up_EFD, w_down_EDF)
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        grads = ctx.captured.backward(ctx.lease, dy_TD, grad_buffers(ctx.weights, ctx.fuse_grads))
        return *grads, None, None, None


class ExpertGraphs:
    """The captured graphs of one layer's expert stage, by signature (module docstring). max_graphs bounds how many
    it keeps over all signatures, and so the memory their pools hold; max_flops (None: no bound) the size of a call
    that may take one (AUTO_MAX_FLOPS for model.moe.cuda_graph=auto)."""

    def __init__(self, max_graphs: int = 4, max_flops: float | None = None):
        self.max_graphs, self.max_flops = max_graphs, max_flops
        self.graphs: dict[tuple, list[_Captured]] = {}
        self.seen: dict[tuple, int] = {}
        self._said_full = False

    def __call__(self, x_TD, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, idx_TK, e_start: int, gemm_impl: str,
                 precision: str, fuse_grads: bool) -> torch.Tensor:
        weights = (w_gate_EFD, w_up_EFD, w_down_EDF)
        grad_on = torch.is_grad_enabled()
        need = tuple(grad_on and t.requires_grad for t in (x_TD, w_TK, *weights))
        call = CallShape(on_cuda=x_TD.is_cuda, precision=precision, grad_wanted=any(need),
                         compiling=torch.compiler.is_compiling(),
                         capturing=x_TD.is_cuda and torch.cuda.is_current_stream_capturing(),
                         saved_tensor_hooks=saved_tensor_hooks_active(),
                         flops=expert_flops(x_TD.shape[0], idx_TK.shape[1], x_TD.shape[1], w_gate_EFD.shape[1]))
        into = grad_buffers(weights, fuse_grads)
        sig = signature(x_TD, w_TK, idx_TK, weights, e_start, gemm_impl, need, into)
        held = self.graphs.get(sig, [])
        free = next((g for g in held if not g.busy), None)
        action = graph_action(call, bool(held), free is not None, self.seen.get(sig, 0), self.count(),
                              self.max_graphs, self.max_flops)
        if action == CAPTURE:
            try:
                free = _Captured(x_TD, w_TK, idx_TK, weights, e_start, gemm_impl, need, into)
                self.graphs.setdefault(sig, []).append(free)
            except Exception as e:  # noqa: BLE001  (a graph is an optimisation: training goes on eager)
                self.max_graphs, self._said_full = self.count(), True
                LOG.warning(f"capturing the expert stage as a CUDA graph failed ({type(e).__name__}: {e}); this "
                            "layer captures nothing more and runs eager where it has no graph")
                action = EAGER
        if action in (CAPTURE, REPLAY):
            return _GraphedExperts.apply(x_TD, w_TK, *weights, idx_TK, free, fuse_grads)
        if action == WARM:
            if len(self.seen) >= 4 * self.max_graphs:  # signatures that never come back: forget them
                self.seen.clear()
            self.seen[sig] = self.seen.get(sig, 0) + 1
        elif (call.on_cuda and call.grad_wanted and not held and not self._said_full
              and self.count() >= self.max_graphs and (self.max_flops is None or call.flops <= self.max_flops)):
            self._said_full = True
            LOG.warning(f"the expert layer holds {self.max_graphs} CUDA graphs already; new input signatures run "
                        "eager (shapes that change every step gain nothing from graphs)")
        return _FastExperts.apply(x_TD, w_TK, *weights, idx_TK, e_start, gemm_impl, precision, fuse_grads)

    def count(self) -> int:
        return sum(len(gs) for gs in self.graphs.values())

    def clear(self) -> None:
        """Drop every graph and its memory pool (e.g. before a phase with other shapes)."""
        self.graphs.clear()
        self.seen.clear()


def signature(x_TD, w_TK, idx_TK, weights, e_start: int, gemm_impl: str, need: tuple[bool, ...], into) -> tuple:
    """What a captured graph bakes in (module docstring): equal signatures can replay one graph."""
    return (x_TD.device, tuple(x_TD.shape), x_TD.dtype, tuple(w_TK.shape), w_TK.dtype, tuple(idx_TK.shape),
            idx_TK.dtype, tuple((w.data_ptr(), tuple(w.shape), w.stride(), w.dtype) for w in weights),
            int(e_start), gemm_impl, need, _ptrs(into))

