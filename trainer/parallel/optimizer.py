"""AdamW over flat parameter buckets: replicated ("none"), ZeRO-1 ("zero1") or EP-aware sharded ("epso").

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

Buffers and master weights: trainer/parallel/buckets.py. Every parameter is a view of its bucket's flat parameter
buffer and every `p.grad` a view of its flat gradient buffer (same dtype as the parameters), kept for the optimizer's
lifetime: `zero_grad()` zeroes the gradient buffer in place and never sets a gradient to None, so autograd
accumulates each backward into it. bf16 parameters therefore accumulate micro-batch gradients in bf16 (an fp32
main-grad beside bf16 weights would cost 4 more bytes per parameter, which the 16-layer OLMoE shape on one 141 GB GPU
cannot spare); bf16 buffers are reduced across ranks in fp32. The fp32 master is the parameter buffer itself for fp32
parameters, and bf16 parameter + int16 remainder for bf16 parameters: optimizer state is 12 bytes of fp32 state per
shard element (as a checkpoint holds it) for 8 (fp32) or 10 (bf16) bytes of memory beside the parameters. Build the
optimizer after the weights are final (loaded, cast and broadcast); after loading weights into the parameters later,
call `sync_master_from_params()`. Code that assigns `p.grad` or `p.data` itself (tests, other tools) still works: the
value is copied into the buffer and the view put back.

Update (kernels/adamw.py): with `fused` (default on CUDA) one Triton pass per shard reads parameter (+ remainder),
moments and gradient (in its own dtype, times the clip coefficient) and writes parameter, remainder and moments;
otherwise the element-wise sequence of torch.optim.AdamW's single-tensor path on fp32 chunks, bitwise equal to it on
CPU for fp32 parameters. A sharded bucket then all-gathers the updated shards into the parameter buffer in the
parameters' dtype.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch
from torch import nn

from moe_launch.errors import CheckpointError, ConfigError
from moe_launch.kernels.adamw import AdamWScalars, adamw_fused_, adamw_reference_, join_master
from moe_launch.trainer.parallel.buckets import Bucket
from moe_launch.trainer.parallel.comm import all_gather_into_, all_reduce_, reduce_scatter, self_axis
from moe_launch.trainer.parallel.groups import Axis, Groups

STRATEGIES = ("none", "zero1", "epso")
CHUNK = 1 << 27  # elements per reference-update / norm chunk: bounds fp32 temporaries to 512 MiB


def is_expert(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_moe_expert", False))


def gets_weight_decay(p: torch.Tensor) -> bool:
    return p.ndim >= 2 and not getattr(p, "_no_weight_decay", False)


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
        """`fused`: the one-pass Triton update (kernels/adamw.py); None = on CUDA only (CPU keeps the bitwise
        reference; fused=True there runs Triton's interpreter)."""
        if strategy not in STRATEGIES:
            raise ConfigError("parallel.optimizer_sharding", f"got {strategy!r}", f"use one of {', '.join(STRATEGIES)}")
        self.groups, self.strategy = groups, strategy
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.step_count = 0
        self._local_sq: Optional[torch.Tensor] = None  # local_grad_norm()'s sum of squares, until zero_grad
        self.buckets = self._make_buckets(named_params)
        device = self.buckets[0].params[0].device if self.buckets else torch.device("cpu")
        self.fused = device.type == "cuda" if fused is None else fused
        for b in self.buckets:
            b.attach_buffers()
            b.init_state()

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
        """(Re)take the fp32 master shards from the current parameters (after loading weights into them); moments
        are kept (zeros on first call)."""
        for b in self.buckets:
            b.adopt_param_storage()
            b.init_state()

    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 optimizer state of this rank's shards, as a checkpoint holds it: master + exp_avg +
        exp_avg_sq (12 per element; in memory the master shares the parameters' storage, see the module docstring)."""
        return sum(12 * b.shard_len for b in self.buckets)

    def optimizer_memory_bytes(self) -> int:
        """Bytes this optimizer holds beside the parameters and their gradients: moments and bf16 remainders."""
        return sum(t.numel() * t.element_size() for b in self.buckets for t in (b.exp_avg, b.exp_avg_sq, b.remainder))

    def state_views(self) -> dict[str, Any]:
        """`state_dict()`'s layout holding the live tensors instead of copies, with the master as it is stored:
        "param_shard" plus "remainder" (bf16 parameters; None for fp32). A checkpoint snapshot copies these to host
        memory without allocating on the device; `state_dict_from_views` turns that copy into the state_dict."""
        return {
            "strategy": self.strategy,
            "step": self.step_count,
            "buckets": {
                b.name: {
                    "param_names": list(b.param_names),
                    "numel": b.numel,
                    "shard_index": b.shard_axis.rank,
                    "shard_count": b.shard_count,
                    "param_shard": b.param_shard,
                    "remainder": b.remainder if b.dtype == torch.bfloat16 else None,
                    "exp_avg": b.exp_avg,
                    "exp_avg_sq": b.exp_avg_sq,
                }
                for b in self.buckets
            },
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards plus the layout needed to reassemble or reshard them (trainer/checkpoint/reshard.py)."""
        views = self.state_views()
        for v in views["buckets"].values():
            for k in ("param_shard", "exp_avg", "exp_avg_sq"):
                v[k] = v[k].clone()
        return state_dict_from_views(views)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load shards saved with the same layout (same strategy and group sizes). The master shard is also this
        rank's shard of the parameters (equal to what the model checkpoint holds there); the rest of the parameters
        come from the model checkpoint."""
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
                    f"{b.shard_axis.rank}/{b.shard_count}; resume through trainer/checkpoint/resume.py, which reshards"
                )
        for b in self.buckets:
            s = saved[b.name]
            b.adopt_param_storage()
            b.master = s["master"]  # split on the parameters' device, in pieces (Bucket.set_master)
            b.exp_avg.copy_(s["exp_avg"])
            b.exp_avg_sq.copy_(s["exp_avg_sq"])
        self.step_count = int(sd["step"])

    # -- the step ------------------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the gradient buffers in place; every p.grad stays (or becomes again) a view into its bucket."""
        self._local_sq = None
        for b in self.buckets:
            b.grad, b.grad_coef = None, 1.0
            b.grad_buffer.zero_()
            for p, view in zip(b.params, b.grad_views):
                if p.grad is not view:
                    p.grad = view

    def local_grad_norm(self) -> torch.Tensor:
        """L2 norm of this rank's own (unreduced) gradients, as a device scalar (no host sync): non-finite iff some
        local gradient is. When the reduction is the identity (one data rank, nothing sharded), `grad_norm()` reuses
        its sum of squares (summed over pipeline stages) instead of reading the gradients again."""
        norms = [torch.linalg.vector_norm(b.flat_grads()[lo : lo + CHUNK], dtype=torch.float32)
                 for b in self.buckets for lo in range(0, b.padded, CHUNK)]
        device = self.buckets[0].grad_buffer.device if self.buckets else torch.device("cpu")
        sq = torch.stack(norms).double().square().sum() if norms else torch.zeros((), dtype=torch.float64,
                                                                                   device=device)
        self._local_sq = sq
        return sq.sqrt()

    def _reduction_is_identity(self) -> bool:
        return self.groups.data_size == 1 and all(b.shard_axis.size == 1 and b.extra_axis.size == 1
                                                  for b in self.buckets)

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

    def _grad_chunks(self, b: Bucket) -> Iterator[tuple[int, torch.Tensor]]:
        for lo in range(0, b.shard_len, CHUNK):
            yield lo, b.grad[lo : lo + CHUNK]

    def grad_norm(self) -> float:
        """The global L2 norm of the reduced gradient: each rank adds the squares of its shards only where it is the
        first of the ranks holding that same shard (extra_axis.rank == 0), then the sum is all-reduced over the world,
        so replicated parameters count once and every expert shard on every EP rank counts. Norms are accumulated in
        fp32 per chunk straight from the gradient's dtype; only the few per-chunk norms are summed in fp64."""
        self._require_reduced()
        cached, self._local_sq = self._local_sq, None
        if cached is not None and self._reduction_is_identity():
            sq = cached.clone()  # the reduced shards are the local buffers (pipeline stages still sum below)
        else:
            device = self.buckets[0].grad.device if self.buckets else torch.device("cpu")
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32)
                     for b in self.buckets if b.extra_axis.rank == 0 for _, g in self._grad_chunks(b)]
            sq = torch.stack(norms).double().square().sum() if norms else torch.zeros((), dtype=torch.float64,
                                                                                       device=device)
        all_reduce_(sq, self.groups.world)
        return math.sqrt(sq.item())  # note: a host sync

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the reduced gradients so that the global norm is at most `max_norm` (0 disables scaling, the norm is
        still returned). Same coefficient as torch.nn.utils.clip_grad_norm_. A non-finite norm is returned without
        touching the gradients: the caller skips the step. The coefficient is applied inside the update, in fp32
        (a bf16 gradient is never rounded again)."""
        norm = self.grad_norm()
        if max_norm > 0 and math.isfinite(norm):
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                for b in self.buckets:
                    b.grad_coef *= coef
        return norm

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self._require_reduced()
        self.step_count += 1
        for b in self.buckets:
            b.adopt_param_storage()
            if b.shard_len:
                s = AdamWScalars(lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                                 weight_decay=b.weight_decay, step=self.step_count, grad_scale=b.grad_coef)
                if self.fused:
                    adamw_fused_(b.param_shard, b.remainder if b.dtype == torch.bfloat16 else None, b.exp_avg,
                                 b.exp_avg_sq, b.grad, s)
                else:
                    self._reference_update(b, s)
            if b.shard_axis.size > 1:
                all_gather_into_(b.param_buffer, b.shard_axis)

    def _reference_update(self, b: Bucket, s: AdamWScalars) -> None:
        """torch.optim.AdamW's element-wise sequence on fp32 master chunks (a view for fp32 parameters, decoded and
        re-encoded for bf16); element-wise, so chunking does not change a bit."""
        for lo, g in self._grad_chunks(b):
            hi = lo + g.numel()
            if b.dtype == torch.float32:
                adamw_reference_(b.param_shard[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi], g, s)
            else:
                master = join_master(b.param_shard[lo:hi], b.remainder[lo:hi])
                adamw_reference_(master, b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi], g, s)
                b.set_master(lo, master)


def state_dict_from_views(views: dict[str, Any]) -> dict[str, Any]:
    """`ShardedAdamW.state_views()` (or a host copy of it) -> the state_dict format: the fp32 "master" joined from
    the parameter shard and remainder on whatever device the views live."""
    buckets = {}
    for name, v in views["buckets"].items():
        master = v["param_shard"] if v["remainder"] is None else join_master(v["param_shard"], v["remainder"])
        buckets[name] = {"param_names": v["param_names"], "numel": v["numel"], "shard_index": v["shard_index"],
                         "shard_count": v["shard_count"], "master": master, "exp_avg": v["exp_avg"],
                         "exp_avg_sq": v["exp_avg_sq"]}
    return {"strategy": views["strategy"], "step": views["step"], "buckets": buckets}


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
