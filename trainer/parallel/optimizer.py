"""AdamW over flat fp32 buckets: replicated ("none"), ZeRO-1 ("zero1") or EP-aware sharded ("epso").

Call order per optimizer step (after forward/backward of every micro-batch):

    opt.reduce_grads()              average gradients over the data ranks, keep this rank's shard
    norm = opt.clip_grad_norm_(c)   the true global norm (each gradient element counted exactly once)
    opt.step(lr)                    AdamW on this rank's shard, then all-gather the updated parameters
    opt.zero_grad()

Buckets. Parameters are grouped by (expert?, weight decay?, dtype) into flat 1-D buckets in model order. Expert
parameters carry `p._moe_expert = True`; they differ across EP ranks and are replicated over DP. Every other
parameter is replicated over DP × EP (EP ranks read different tokens).

Weight decay (decoupled, as torch.optim.AdamW): every parameter with ndim >= 2 (linear weights, embeddings, expert
weights) unless it carries `p._no_weight_decay = True`; norms' gains and biases (ndim < 2) get none.

Sharding (one bucket = padded to a multiple of the shard-axis size and cut into equal shards):

    strategy  non-expert state sharded over   expert state sharded over
    none      - (replicated)                  - (replicated)
    zero1     DP                              DP
    epso      DP × EP                         DP

Gradient reduction = reduce-scatter over the shard axis, then all-reduce of the shard over the remaining "extra" axis
(the ranks that hold the same shard index but saw other tokens: EP for zero1's non-expert buckets, everything for
"none"), then divide by data_size = dp*ep. Dividing expert gradients by dp*ep (not dp) is deliberate: each rank's loss
is a mean over its own tokens and an expert's gradient already sums the contributions of all EP ranks' tokens (they
reached it through the token exchange), so the global-mean loss needs 1/(dp*ep).

Master weights are fp32 copies of this rank's shard (the model's parameters may be bf16); the optimizer state per
shard element is master + exp_avg + exp_avg_sq = 12 bytes. Build the optimizer after the weights are final (loaded
and broadcast), or call `sync_master_from_params()` afterwards.

Gradient buffers (as DDP's gradient_as_bucket_view / Megatron's contiguous grad buffer). Each bucket owns one flat,
padded gradient buffer and every `p.grad` is a view into it, set at construction and kept: `zero_grad()` zeroes the
buffer in place and never sets a gradient to None, so autograd's AccumulateGrad adds each backward's gradient into
the view (it replaces `.grad` only while it is undefined) and the buffer IS the bucket's flat gradient: no
concatenation, no second copy. The buffer has the parameters' dtype, because `.grad` must match its parameter's dtype:
fp32 parameters (bf16 autocast) get an fp32 buffer; bf16 parameters get a bf16 buffer, i.e. micro-batches accumulate
in bf16. We chose that over an fp32 main-grad filled by hooks because an fp32 buffer beside bf16 weights costs 4 more
bytes per parameter, which is what the 16-layer OLMoE shape on one 141 GB GPU cannot spare. bf16 buffers are reduced
in fp32 across ranks (a temporary fp32 copy, as before) and converted to fp32 chunk by chunk for the norm and update.
Code that assigns `p.grad` itself (tests, other tools) still works: `reduce_grads()` copies a gradient that is not the
view into the buffer (None counts as zeros) and puts the view back. After `reduce_grads()` the buffer's content is
scratch (it may hold the reduced, clipped gradient) until `zero_grad()`.

Update. On CUDA the AdamW update runs as `torch._fused_adamw_` (one multi-tensor kernel per weight-decay value and
chunk list, same math as torch.optim.AdamW: decoupled decay, bias correction, eps outside the sqrt); elsewhere (and
with fused=False) the element-wise sequence of torch.optim.AdamW's single-tensor path, bitwise equal to it on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from moe_launch.errors import CheckpointError, ConfigError
from moe_launch.trainer.parallel.comm import all_gather, all_reduce_, reduce_scatter, self_axis
from moe_launch.trainer.parallel.groups import Axis, Groups

STRATEGIES = ("none", "zero1", "epso")
CHUNK = 1 << 27  # elements per update/norm chunk: bounds the fp32 copy of a bf16 gradient to 512 MiB


def is_expert(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_moe_expert", False))


def gets_weight_decay(p: torch.Tensor) -> bool:
    return p.ndim >= 2 and not getattr(p, "_no_weight_decay", False)


@dataclass
class Bucket:
    """A flat run of parameters sharing (kind, decay, dtype); this rank owns [shard_lo, shard_lo + shard_len)."""

    name: str  # e.g. "expert.decay.float32"; the key in state dicts
    expert: bool
    weight_decay: float
    params: list[nn.Parameter]
    param_names: list[str]
    offsets: list[int]  # start of each parameter in the unpadded flat layout
    numel: int  # unpadded
    shard_axis: Axis  # ranks holding different shards of this bucket
    extra_axis: Axis  # ranks holding the same shard index that saw different tokens (gradients summed over them)
    master: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # fp32 [shard_len]
    exp_avg: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    exp_avg_sq: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    grad: Optional[torch.Tensor] = None  # [shard_len], the reduced gradient shard after reduce_grads()
    grad_coef: float = 1.0  # clip coefficient not yet applied to `grad` (only for a non-fp32 `grad`)
    grad_buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [padded], the params' dtype
    grad_views: list[torch.Tensor] = field(default_factory=list)  # p.grad of each parameter, views of grad_buffer

    @property
    def shard_count(self) -> int:
        return self.shard_axis.size

    @property
    def shard_len(self) -> int:
        return math.ceil(self.numel / self.shard_count) if self.numel else 0

    @property
    def padded(self) -> int:
        return self.shard_len * self.shard_count

    @property
    def shard_lo(self) -> int:
        return self.shard_axis.rank * self.shard_len

    def param_pieces(self, lo: int, hi: int):
        """(param, start in param, start in [lo, hi), length) of every parameter overlapping flat range [lo, hi)."""
        for p, off in zip(self.params, self.offsets):
            a, c = max(lo, off), min(hi, off + p.numel())
            if a < c:
                yield p, a - off, a - lo, c - a

    def flat_params(self, dtype: torch.dtype, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """Flat range [lo, hi) of the padded parameter layout (padding zero) in `dtype`, without a full flat copy."""
        hi = self.padded if hi is None else hi
        out = torch.zeros(hi - lo, dtype=dtype, device=self.params[0].device)
        for p, src, dst, n in self.param_pieces(lo, hi):
            out[dst : dst + n].copy_(p.detach().reshape(-1)[src : src + n])
        return out

    def attach_grad_buffer(self) -> None:
        """Allocate the flat gradient buffer and make every parameter's .grad a view into it."""
        self.grad_buffer = torch.zeros(self.padded, dtype=self.params[0].dtype, device=self.params[0].device)
        self.grad_views = [self.grad_buffer[off : off + p.numel()].view_as(p)
                           for p, off in zip(self.params, self.offsets)]
        for p, view in zip(self.params, self.grad_views):
            p.grad = view

    def flat_grads(self) -> torch.Tensor:
        """The padded flat gradient: the buffer itself. A gradient that someone assigned instead of accumulating into
        the view is copied in (None: zeros), and the view is put back."""
        for p, view in zip(self.params, self.grad_views):
            g = p.grad
            if g is None or g.data_ptr() != view.data_ptr() or g.shape != view.shape or g.dtype != view.dtype:
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
                p.grad = view
        return self.grad_buffer

    def grad_chunks(self):
        """The reduced gradient shard as fp32 chunks of at most CHUNK elements (views when it is fp32 already;
        a deferred clip coefficient is applied to converted chunks)."""
        for lo in range(0, self.shard_len, CHUNK):
            g = self.grad[lo : lo + CHUNK]
            if g.dtype != torch.float32:
                g = g.float()
                if self.grad_coef != 1.0:
                    g.mul_(self.grad_coef)
            yield lo, g


def _axes_for(strategy: str, expert: bool, groups: Groups) -> tuple[Axis, Axis]:
    """(shard_axis, extra_axis) of a bucket. See the table in the module docstring."""
    me = self_axis(groups.world_rank)
    if strategy == "none":
        return me, (groups.dp if expert else groups.dp_ep)
    if strategy == "zero1":
        return groups.dp, (me if expert else groups.ep)
    return (groups.dp, me) if expert else (groups.dp_ep, me)


class ShardedAdamW:
    """AdamW with torch.optim.AdamW's update rule (decoupled weight decay, bias correction, eps outside the sqrt)."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        groups: Groups,
        strategy: str,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        fused: Optional[bool] = None,
    ):
        """`fused`: use torch._fused_adamw_ for the update; None = on CUDA only (CPU keeps the bitwise reference)."""
        if strategy not in STRATEGIES:
            raise ConfigError("parallel.optimizer_sharding", f"got {strategy!r}", f"use one of {', '.join(STRATEGIES)}")
        self.groups, self.strategy = groups, strategy
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.step_count = 0
        self.buckets = self._make_buckets(named_params)
        device = self.buckets[0].params[0].device if self.buckets else torch.device("cpu")
        self.fused = device.type == "cuda" if fused is None else fused
        for b in self.buckets:
            b.attach_grad_buffer()
        self.sync_master_from_params()

    def _make_buckets(self, named_params: list[tuple[str, nn.Parameter]]) -> list[Bucket]:
        members: dict[tuple[bool, bool, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        for name, p in named_params:
            if p.requires_grad:
                members.setdefault((is_expert(p), gets_weight_decay(p), p.dtype), []).append((name, p))
        buckets = []
        # a fixed key order: every rank of a shard group must build identical bucket lists
        for (expert, decay, dtype) in sorted(members, key=lambda k: (not k[0], not k[1], str(k[2]))):
            items = members[(expert, decay, dtype)]
            offsets, total = [], 0
            for _, p in items:
                offsets.append(total)
                total += p.numel()
            shard_axis, extra_axis = _axes_for(self.strategy, expert, self.groups)
            kind = "expert" if expert else "dense"
            buckets.append(
                Bucket(
                    name=f"{kind}.{'decay' if decay else 'no_decay'}.{str(dtype).removeprefix('torch.')}",
                    expert=expert,
                    weight_decay=self.weight_decay if decay else 0.0,
                    params=[p for _, p in items],
                    param_names=[n for n, _ in items],
                    offsets=offsets,
                    numel=total,
                    shard_axis=shard_axis,
                    extra_axis=extra_axis,
                )
            )
        return buckets

    # -- state -------------------------------------------------------------------------------------------------
    def sync_master_from_params(self) -> None:
        """(Re)take the fp32 master shards from the current parameters; moments are kept (zeros on first call)."""
        for b in self.buckets:
            lo, n = b.shard_lo, b.shard_len
            b.master = b.flat_params(torch.float32, lo, lo + n)
            if b.exp_avg.numel() != n:
                b.exp_avg = torch.zeros_like(b.master)
                b.exp_avg_sq = torch.zeros_like(b.master)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank: fp32 master + exp_avg + exp_avg_sq of its shards."""
        return sum(t.numel() * t.element_size() for b in self.buckets for t in (b.master, b.exp_avg, b.exp_avg_sq))

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards plus the layout needed to reassemble or reshard them (see trainer/parallel/ckpt)."""
        return {
            "strategy": self.strategy,
            "step": self.step_count,
            "buckets": {
                b.name: {
                    "param_names": list(b.param_names),
                    "numel": b.numel,
                    "shard_index": b.shard_axis.rank,
                    "shard_count": b.shard_count,
                    "master": b.master.clone(),
                    "exp_avg": b.exp_avg.clone(),
                    "exp_avg_sq": b.exp_avg_sq.clone(),
                }
                for b in self.buckets
            },
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load shards saved with the same layout (same strategy and group sizes). The model's parameters are left
        as they are: load them from the model checkpoint."""
        saved = sd["buckets"]
        if set(saved) != {b.name for b in self.buckets}:
            raise CheckpointError(
                f"optimizer buckets {sorted(saved)} do not match this model's {[b.name for b in self.buckets]}; "
                "resume with the same model config, or start from a model-only checkpoint (model.init_from=ckpt:...)"
            )
        for b in self.buckets:
            s = saved[b.name]
            if s["param_names"] != b.param_names or s["numel"] != b.numel:
                raise CheckpointError(f"bucket {b.name}: parameter list differs from the checkpoint; "
                                      "resume with the same model.* config")
            if s["shard_count"] != b.shard_count or s["shard_index"] != b.shard_axis.rank:
                raise CheckpointError(
                    f"bucket {b.name}: saved as shard {s['shard_index']}/{s['shard_count']}, this rank holds "
                    f"{b.shard_axis.rank}/{b.shard_count}; load through trainer.parallel.ckpt, which reshards"
                )
            for key in ("master", "exp_avg", "exp_avg_sq"):
                getattr(b, key).copy_(s[key])
        self.step_count = int(sd["step"])

    # -- the step ------------------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the gradient buffers in place; every p.grad stays (or becomes again) a view into its bucket."""
        for b in self.buckets:
            b.grad, b.grad_coef = None, 1.0
            b.grad_buffer.zero_()
            for p, view in zip(b.params, b.grad_views):
                if p.grad is not view:
                    p.grad = view

    def reduce_grads(self) -> None:
        """Average the gradients over the data ranks (see the module docstring) into per-bucket shards. Without
        communication the shard is the buffer itself (its own dtype); otherwise it is reduced in fp32."""
        scale = 1.0 / self.groups.data_size
        for b in self.buckets:
            flat = b.flat_grads()
            if (b.shard_axis.size > 1 or b.extra_axis.size > 1) and flat.dtype != torch.float32:
                flat = flat.float()  # sum over ranks in fp32, as torch.optim would see it
            shard = reduce_scatter(flat, b.shard_axis)  # the buffer itself on a single-member axis
            all_reduce_(shard, b.extra_axis)
            if scale != 1.0:
                shard.mul_(scale)
            b.grad, b.grad_coef = shard, 1.0

    def _require_reduced(self) -> None:
        if any(b.grad is None for b in self.buckets):
            raise RuntimeError("call reduce_grads() after backward and before clip_grad_norm_() / step()")

    def grad_norm(self) -> float:
        """The global L2 norm of the reduced gradient: each rank adds the squares of its shards only where it is the
        first of the ranks holding that same shard (extra_axis.rank == 0), then the sum is all-reduced over the world,
        so replicated parameters count once and every expert shard on every EP rank counts. Norms are taken in fp32
        per chunk; only the few per-chunk squares are summed in fp64."""
        self._require_reduced()
        device = self.buckets[0].master.device if self.buckets else torch.device("cpu")
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32)
                 for b in self.buckets if b.extra_axis.rank == 0 for _, g in b.grad_chunks()]
        sq = torch.stack(norms).double().square().sum() if norms else torch.zeros((), dtype=torch.float64,
                                                                                   device=device)
        all_reduce_(sq, self.groups.world)
        return math.sqrt(sq.item())  # note: a host sync

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the reduced gradients so that the global norm is at most `max_norm` (0 disables scaling, the norm is
        still returned). Same coefficient as torch.nn.utils.clip_grad_norm_. A non-finite norm is returned without
        touching the gradients: the caller skips the step. A bf16 shard is scaled when converted (no bf16 rounding)."""
        norm = self.grad_norm()
        if max_norm > 0 and math.isfinite(norm):
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                for b in self.buckets:
                    if b.grad.dtype == torch.float32:
                        b.grad.mul_(coef)
                    else:
                        b.grad_coef *= coef
        return norm

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self._require_reduced()
        self.step_count += 1
        for b in self.buckets:
            if b.shard_len:
                (self._fused_update if self.fused else self._reference_update)(b, lr)
            self._write_back(b)

    def _reference_update(self, b: Bucket, lr: float) -> None:
        """The same element-wise sequence as torch.optim.AdamW (single-tensor path); element-wise, so chunking does
        not change a bit."""
        t = self.step_count
        bias_correction1 = 1 - self.beta1**t
        bias_correction2_sqrt = (1 - self.beta2**t) ** 0.5
        step_size = lr / bias_correction1
        for lo, g in b.grad_chunks():
            hi = lo + g.numel()
            master, exp_avg, exp_avg_sq = b.master[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi]
            if b.weight_decay:
                master.mul_(1 - lr * b.weight_decay)
            exp_avg.lerp_(g, 1 - self.beta1)
            exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
            master.addcdiv_(exp_avg, denom, value=-step_size)

    def _fused_update(self, b: Bucket, lr: float) -> None:
        """torch._fused_adamw_ over the bucket's chunks (one kernel per chunk list; the step count is read, not
        incremented, by the kernel). Lists are built per chunk so a bf16 gradient is converted 512 MiB at a time."""
        step_t = torch.full((), float(self.step_count), dtype=torch.float32, device=b.master.device)
        masters, grads, avgs, avg_sqs = [], [], [], []
        for lo, g in b.grad_chunks():
            hi = lo + g.numel()
            masters.append(b.master[lo:hi])
            grads.append(g)
            avgs.append(b.exp_avg[lo:hi])
            avg_sqs.append(b.exp_avg_sq[lo:hi])
            if g.dtype != b.grad.dtype or hi == b.shard_len:  # a converted copy runs at once (memory)
                torch._fused_adamw_(masters, grads, avgs, avg_sqs, [], [step_t] * len(masters), lr=lr,
                                    beta1=self.beta1, beta2=self.beta2, weight_decay=b.weight_decay, eps=self.eps,
                                    amsgrad=False, maximize=False)
                masters, grads, avgs, avg_sqs = [], [], [], []

    def _write_back(self, b: Bucket) -> None:
        """Copy the updated master into the parameters (casting to their dtype); with a sharded bucket, all-gather
        the shards in the parameters' dtype first (half the bytes for bf16)."""
        if b.shard_axis.size == 1:
            for p, src, dst, n in b.param_pieces(0, b.numel):
                p.data.view(-1)[src : src + n].copy_(b.master[dst : dst + n])
            return
        full = all_gather(b.master.to(b.params[0].dtype), b.shard_axis)
        for p, off in zip(b.params, b.offsets):
            p.data.copy_(full[off : off + p.numel()].view_as(p))


def build_optimizer(model: nn.Module, train_cfg: Any, parallel_cfg: Any, groups: Groups,
                    lr: Optional[float] = None) -> ShardedAdamW:
    """AdamW for `model` with the sharding strategy `parallel.optimizer_sharding`; betas/eps/weight_decay from
    `train`. `lr` is accepted for symmetry with torch optimizers; the learning rate is passed to every `step(lr)`."""
    del lr
    return ShardedAdamW(
        list(model.named_parameters()),
        groups,
        parallel_cfg.optimizer_sharding,
        betas=(train_cfg.beta1, train_cfg.beta2),
        eps=train_cfg.eps,
        weight_decay=train_cfg.weight_decay,
    )
