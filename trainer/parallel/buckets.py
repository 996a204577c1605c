"""One optimizer bucket: a flat run of parameters that share (expert?, weight decay?, dtype), with flat parameter and
gradient buffers that the parameters and their `.grad` are views of, and this rank's shard of the AdamW state.

Shapes: N = `padded` elements of the bucket's flat layout (unpadded `numel` plus zero padding up to a multiple of the
shard count), S = `shard_len` elements of this rank's shard [shard_lo, shard_lo + S).

Flat buffers (Megatron's contiguous param/grad buffers, DDP's gradient_as_bucket_view). `attach_buffers()` copies the
parameters into one flat buffer and makes every `p.data` a view of it, and makes every `p.grad` a view of a flat
gradient buffer of the same dtype. Autograd's AccumulateGrad adds into an existing `.grad`, so backward writes the
bucket's flat gradient directly; `zero_grad` zeroes it in place. The update then reads the gradient shard and writes
the parameter shard in place, and a sharded bucket all-gathers straight into the parameter buffer.

Master weights (the fp32 values AdamW updates), per parameter dtype:
  fp32  the parameter buffer's shard IS the master (no copy);
  bf16  the master is split into the bf16 parameter (its rounding, the high 16 bits) and an int16 `remainder`
        [S] (kernels/adamw.py): exact fp32 arithmetic for 2 extra bytes per element instead of 4.
`master` reads as an fp32 [S] tensor either way (a view for fp32, a decoded copy for bf16); assigning it (resume,
resharding) writes the parameters' shard too, which is what the parameters must hold anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from moe_launch.errors import ConfigError
from moe_launch.kernels.adamw import join_master, split_master
from moe_launch.trainer.parallel.groups import Axis

_SPLIT_PIECE = 1 << 26  # elements per piece when a master is split into parameters + remainder (256 MB in fp32)

MASTER_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Bucket:
    name: str  # e.g. "expert.decay.float32"; the key in state dicts
    expert: bool
    weight_decay: float
    params: list[nn.Parameter]
    param_names: list[str]
    offsets: list[int]  # start of each parameter in the unpadded flat layout
    numel: int  # unpadded
    shard_axis: Axis  # ranks holding different shards of this bucket
    extra_axis: Axis  # ranks holding the same shard index that saw different tokens (gradients summed over them)
    exp_avg: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # fp32 [S]
    exp_avg_sq: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # fp32 [S]
    remainder: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int16))  # int16 [S], bf16 only
    grad: Optional[torch.Tensor] = None  # [S], the reduced gradient shard after reduce_grads()
    grad_coef: float = 1.0  # clip coefficient not yet applied to `grad`
    param_buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [N], the params' dtype
    grad_buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [N], the params' dtype
    grad_views: list[torch.Tensor] = field(default_factory=list)  # p.grad of each parameter, views of grad_buffer

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

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

    @property
    def param_shard(self) -> torch.Tensor:
        """This rank's shard of the parameter buffer [S] (the parameters' dtype)."""
        return self.param_buffer[self.shard_lo : self.shard_lo + self.shard_len]

    def param_pieces(self, lo: int, hi: int) -> Iterator[tuple[nn.Parameter, int, int, int]]:
        """(param, start in param, start in [lo, hi), length) of every parameter overlapping flat range [lo, hi)."""
        for p, off in zip(self.params, self.offsets):
            a, c = max(lo, off), min(hi, off + p.numel())
            if a < c:
                yield p, a - off, a - lo, c - a

    # -- buffers ---------------------------------------------------------------------------------------------------
    def attach_buffers(self) -> None:
        """Move the parameters into one flat buffer (p.data becomes a view) and give them flat-buffer gradients."""
        if self.dtype not in MASTER_DTYPES:
            raise ConfigError("train.param_dtype", f"parameters of dtype {self.dtype} (bucket {self.name})",
                              "use fp32 or bf16 parameters")
        device = self.params[0].device
        self.param_buffer = torch.zeros(self.padded, dtype=self.dtype, device=device)
        self.grad_buffer = torch.zeros(self.padded, dtype=self.dtype, device=device)
        self.grad_views = []
        for p, off in zip(self.params, self.offsets):
            view = self.param_buffer[off : off + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
            self.grad_views.append(self.grad_buffer[off : off + p.numel()].view_as(p))
            p.grad = self.grad_views[-1]

    def adopt_param_storage(self) -> None:
        """Make sure every parameter still lives in the buffer (someone may have assigned p.data since); copy a
        replaced parameter back in and restore the view."""
        for p, off in zip(self.params, self.offsets):
            view = self.param_buffer[off : off + p.numel()].view_as(p)
            if p.data.data_ptr() != view.data_ptr() or p.dtype != view.dtype:
                view.copy_(p.detach())
                p.data = view

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

    # -- master ----------------------------------------------------------------------------------------------------
    @property
    def master(self) -> torch.Tensor:
        """The fp32 master shard [S]: a view of the parameters (fp32) or decoded from parameters + remainder."""
        if self.dtype == torch.float32:
            return self.param_shard
        return join_master(self.param_shard, self.remainder)

    @master.setter
    def master(self, values_S: torch.Tensor) -> None:
        self.set_master(0, values_S)

    def set_master(self, lo: int, values: torch.Tensor) -> None:
        """Write fp32 master values at shard offset lo (and so the parameters' shard there)."""
        hi = lo + values.numel()
        if self.dtype == torch.float32:
            self.param_shard[lo:hi].copy_(values)
        else:  # split where the parameters live (a restore passes host tensors), in pieces: its temporaries are small
            for a in range(0, values.numel(), _SPLIT_PIECE):
                piece = values[a:a + _SPLIT_PIECE].to(self.param_shard.device, torch.float32)
                p, rem = split_master(piece)
                self.param_shard[lo + a:lo + a + piece.numel()].copy_(p)
                self.remainder[lo + a:lo + a + piece.numel()].copy_(rem)

    def init_state(self) -> None:
        """Zero moments (kept if already sized); a bf16 master restarts at the parameters (remainder zero)."""
        n = self.shard_len
        if self.exp_avg.numel() != n:
            self.exp_avg = torch.zeros(n, dtype=torch.float32, device=self.param_buffer.device)
            self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        if self.dtype == torch.bfloat16:
            self.remainder = torch.zeros(n, dtype=torch.int16, device=self.param_buffer.device)
