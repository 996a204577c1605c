"""Build this rank's pipeline stage and run one step (forward + backward of every micro-batch) through it.

    pipe = build_pipeline(model_cfg, parallel_cfg, groups, device)      # after torch.manual_seed(train.seed)
    loss, parts = pipeline_step(pipe, micro_batches, loss_scale=1 / M)  # gradients are in pipe.model's .grad

The step executes this stage's program (trainer/pipeline/plan.py): Compute actions run a chunk forward or backward,
Exchange actions post one round of point-to-point messages (trainer/pipeline/p2p.py). Receives are waited for only
right before the action that consumes them; sends are waited for at the end of the step.

MoE losses under PP (the pitfall: a stage that only backpropagates the gradient it received drops the load-balancing
and z-losses of its own layers). Every chunk's backward starts from TWO roots: its output, with the gradient received
from the next chunk, and its own coefficient-weighted aux + z losses (scaled like the lm loss), with gradient 1. The
last chunk's root is lm + its aux + z. Summed over chunks this is the gradient of
    loss_scale * sum_m [ lm_m + aux_coef * sum_l aux_{l,m} + z_coef * sum_l z_{l,m} ]
exactly what the unpipelined `Transformer.compute_loss` backpropagates.

Shapes: B micro-batch size, S sequence, D model dim, E experts, L layers.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_launch.errors import ConfigError
from moe_launch.trainer.model.transformer import LossParts
from moe_launch.trainer.parallel.dispatch import attach_dispatchers
from moe_launch.trainer.parallel.groups import Groups
from moe_launch.trainer.pipeline.p2p import Pending, post_round
from moe_launch.trainer.pipeline.plan import (
    Exchange,
    Message,
    Op,
    build_programs,
    input_message,
    is_local,
    output_message,
)
from moe_launch.trainer.pipeline.schedule import Action, build_schedule
from moe_launch.trainer.pipeline.split import chunk_layers
from moe_launch.trainer.pipeline.stage import ChunkOut, StageModel, balance_costs, build_stage_model


@dataclass
class Pipeline:
    model: StageModel  # this stage's modules; give it to the optimizer, the checkpoint code and apply_recompute
    groups: Groups
    schedule: str
    virtual: int
    chunk_ranges: list[range]  # layers of every chunk of the whole model (all stages)
    model_cfg: Any
    _programs: dict[int, list[Op]] = field(default_factory=dict)

    @property
    def pp(self) -> int:
        return self.groups.pp_size

    @property
    def stage(self) -> int:
        return self.groups.pp_rank

    @property
    def n_chunks(self) -> int:
        return self.pp * self.virtual

    def orders(self, microbatches: int) -> list[list[Action]]:
        return build_schedule(self.schedule, self.pp, microbatches, self.virtual)

    def program(self, microbatches: int) -> list[Op]:
        if microbatches not in self._programs:
            self._programs[microbatches] = build_programs(self.orders(microbatches), self.virtual)[self.stage]
        return self._programs[microbatches]


def build_pipeline(model_cfg: Any, parallel_cfg: Any, groups: Groups,
                   device: Optional[torch.device | str] = None) -> Pipeline:
    """This rank's stage of the model (its chunks c with c % pp == pp_rank), initialised like the PP=1 model, with the
    EP token exchange attached. Collective over the pp group (a first collective that sets up the communicator, which
    NCCL needs before subsets of ranks may exchange point-to-point)."""
    pp, v = groups.pp_size, parallel_cfg.pp_virtual_stages
    if parallel_cfg.pp != pp:
        raise ConfigError("parallel.pp", f"{parallel_cfg.pp} but the process groups have pp={pp}",
                          "build the groups from the same parallel config")
    n_chunks = pp * v
    ranges = chunk_layers(model_cfg.n_layers, n_chunks, list(parallel_cfg.pp_split),
                          *balance_costs(model_cfg, parallel_cfg.pp_balance))
    # configuration errors now rather than in the first step
    build_schedule(parallel_cfg.pp_schedule, pp, max(parallel_cfg.microbatches, pp), v)
    mine = {c: ranges[c] for c in range(n_chunks) if c % pp == groups.pp_rank}
    model = build_stage_model(model_cfg, mine, n_chunks, groups.ep_rank, groups.ep_size, device)
    attach_dispatchers(model, model_cfg, groups)
    if pp > 1:
        warm = torch.zeros(1, device=next(model.parameters()).device)
        dist.all_reduce(warm, group=groups.pp_group)
    return Pipeline(model=model, groups=groups, schedule=parallel_cfg.pp_schedule, virtual=v, chunk_ranges=ranges,
                    model_cfg=model_cfg)


@dataclass
class _Sums:
    """Detached running sums over micro-batches of this stage's loss parts."""

    lm: torch.Tensor
    aux: torch.Tensor  # coefficient-weighted
    z: torch.Tensor
    aux_L: torch.Tensor  # unweighted, per global layer (zero for layers of other stages)
    z_L: torch.Tensor
    counts_LE: torch.Tensor


class _StepState:
    def __init__(self, pipe: Pipeline, micro_batches: list[torch.Tensor], scale: float,
                 autocast_dtype: Optional[torch.dtype]):
        self.pipe, self.model, self.scale = pipe, pipe.model, scale
        self.mbs = micro_batches
        p0 = next(self.model.parameters())
        self.device, self.act_dtype = p0.device, p0.dtype
        B, S1 = micro_batches[0].shape
        self.act_shape = (B, S1 - 1, pipe.model_cfg.d_model)
        self.autocast_dtype = autocast_dtype
        cfg = pipe.model_cfg
        self.aux_coef, self.z_coef = cfg.moe.aux_loss_weight, cfg.moe.z_loss_coef
        L, E = cfg.n_layers, cfg.moe.num_experts
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=self.device)  # noqa: E731
        self.sums = _Sums(zeros(()), zeros(()), zeros(()), zeros(L), zeros(L), zeros(L, E))
        self.saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]] = {}
        self.outbox: dict[Message, torch.Tensor] = {}  # produced, not yet posted (or handed over locally)
        self.arrived: dict[Message, tuple[torch.Tensor, Pending]] = {}
        self.sending: list[Pending] = []

    # -- messages ------------------------------------------------------------------------------------------------
    def take(self, msg: Message) -> torch.Tensor:
        if is_local(msg, self.pipe.pp):
            return self.outbox.pop(msg)
        buf, pending = self.arrived.pop(msg)
        pending.wait()
        return buf

    def exchange(self, op: Exchange) -> None:
        pp, axis = self.pipe.pp, self.pipe.groups.pp
        sends = [(self.outbox.pop(m), axis.global_rank(m.dst_stage(pp))) for m in op.sends]
        bufs = [torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device) for _ in op.recvs]
        pending = post_round(sends, [(b, axis.global_rank(m.src_stage(pp))) for b, m in zip(bufs, op.recvs)],
                             axis.group)
        for buf, m in zip(bufs, op.recvs):
            self.arrived[m] = (buf, pending)
        if op.sends:
            self.sending.append(pending)

    # -- compute -------------------------------------------------------------------------------------------------
    def forward(self, a: Action) -> None:
        n = self.pipe.n_chunks
        mb_BS1 = self.mbs[a.mb]
        first, last = a.chunk == 0, a.chunk == n - 1
        x_in = None if first else self.take(input_message(a, n)).requires_grad_()
        with self._autocast():
            res: ChunkOut = self.model.forward_chunk(a.chunk, mb_BS1[:, :-1] if first else x_in,
                                                     mb_BS1[:, 1:] if last else None)
        local = self._record_router_losses(res)
        if last:
            self.sums.lm += res.out.detach().double()
            root = res.out * self.scale + (local * self.scale if local is not None else 0.0)
            self.saved[(a.chunk, a.mb)] = (x_in, root, None)
        else:
            self.saved[(a.chunk, a.mb)] = (x_in, res.out, local * self.scale if local is not None else None)
            self.outbox[output_message(a, n)] = res.out.detach().to(self.act_dtype)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _record_router_losses(self, res: ChunkOut) -> Optional[torch.Tensor]:
        """This chunk's coefficient-weighted aux + z loss (with gradient), after recording the detached parts."""
        if not res.stats:
            return None
        aux = torch.stack([s.aux_loss for s in res.stats])
        z = torch.stack([s.z_loss for s in res.stats])
        idx = torch.tensor(res.layers, device=self.device)
        self.sums.aux_L.index_add_(0, idx, aux.detach().double())
        self.sums.z_L.index_add_(0, idx, z.detach().double())
        self.sums.counts_LE.index_add_(0, idx, torch.stack([s.counts_E for s in res.stats]).double())
        weighted_aux, weighted_z = aux.sum() * self.aux_coef, z.sum() * self.z_coef
        self.sums.aux += weighted_aux.detach().double()
        self.sums.z += weighted_z.detach().double()
        return weighted_aux + weighted_z

    def backward(self, a: Action) -> None:
        n = self.pipe.n_chunks
        x_in, out, local = self.saved.pop((a.chunk, a.mb))
        if a.chunk == n - 1:
            torch.autograd.backward(out)
        else:
            grad = self.take(input_message(a, n)).to(out.dtype)
            roots, grads = [out], [grad]
            if local is not None:
                roots.append(local)
                grads.append(None)
            torch.autograd.backward(roots, grads)
        if a.chunk > 0:
            self.outbox[output_message(a, n)] = x_in.grad

    def finish(self) -> None:
        for pending in self.sending:
            pending.wait()
        leftovers = [k for k in (*self.outbox, *self.arrived, *self.saved)]
        if leftovers:
            raise RuntimeError(f"pipeline step ended with unconsumed state {leftovers[:4]}: inconsistent program")


def pipeline_step(pipe: Pipeline, micro_batches: list[torch.Tensor], loss_scale: Optional[float] = None,
                  autocast_dtype: Optional[torch.dtype] = None, reduce: bool = True,
                  timings: Optional[list] = None) -> tuple[torch.Tensor, LossParts]:
    """Forward and backward of every micro-batch ([B, S+1] token tensors; inputs [:, :-1], targets [:, 1:]) through
    the pipeline; accumulates gradients into pipe.model (call the optimizer afterwards). Every stage of a pipeline
    passes the same micro-batches (only the first chunk reads the inputs, only the last the targets).

    loss_scale multiplies every micro-batch's loss before backward (default 1/M: the mean over micro-batches).
    Returns (loss, parts) as `Transformer.compute_loss` does, as means over the micro-batches: with reduce=True (one
    small all-reduce over the pp group) every stage gets the whole model's values (lm loss from the last stage, every
    layer's aux / z losses and expert counts from the stage holding it); with reduce=False only this stage's part.
    `timings`, if given, receives (action, start_s, end_s) per compute action, synchronising the device around each
    (for the benchmark's bubble measurement; it serialises communication with compute)."""
    M = len(micro_batches)
    if M == 0 or any(mb.shape != micro_batches[0].shape for mb in micro_batches):
        raise ValueError("pipeline_step needs at least one micro-batch, all of the same shape")
    st = _StepState(pipe, micro_batches, 1.0 / M if loss_scale is None else loss_scale, autocast_dtype)
    sync = (lambda: torch.cuda.synchronize(st.device)) if st.device.type == "cuda" else (lambda: None)
    for op in pipe.program(M):
        if isinstance(op, Exchange):
            st.exchange(op)
            continue
        if timings is not None:
            sync()
            t0 = time.perf_counter()
        (st.forward if op.action.kind == "F" else st.backward)(op.action)
        if timings is not None:
            sync()
            timings.append((op.action, t0, time.perf_counter()))
    st.finish()
    return _loss_parts(pipe, st.sums, M, reduce)


def _loss_parts(pipe: Pipeline, sums: _Sums, M: int, reduce: bool) -> tuple[torch.Tensor, LossParts]:
    L = pipe.model_cfg.n_layers
    flat = torch.cat([torch.stack([sums.lm, sums.aux, sums.z]), sums.aux_L, sums.z_L, sums.counts_LE.flatten()])
    if reduce and pipe.pp > 1:
        dist.all_reduce(flat, group=pipe.groups.pp_group)  # note: a small collective; stages wait for the last one
    lm, aux, z = (flat[:3] / M).float().unbind()
    aux_L, z_L = flat[3 : 3 + L] / M, flat[3 + L : 3 + 2 * L] / M
    counts_LE = flat[3 + 2 * L :].view(L, -1).round().long()
    moe_layers = range(L) if pipe.model_cfg.kind == "moe" else range(0)
    if not reduce:
        moe_layers = [i for c in pipe.model.chunks for i in pipe.chunk_ranges[c] if i in moe_layers]
    parts = LossParts(lm_loss=lm, aux_loss=aux, z_loss=z, aux_per_layer=[aux_L[i].float() for i in moe_layers],
                      z_per_layer=[z_L[i].float() for i in moe_layers],
                      counts_per_layer=[counts_LE[i] for i in moe_layers])
    return lm + aux + z, parts
