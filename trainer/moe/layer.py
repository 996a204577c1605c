"""The MoE feed-forward layer: router, its losses, then expert computation through a replaceable dispatcher.

Shapes: B batch, S sequence, T = B*S tokens, D model dim, F expert hidden, E_local experts owned by this rank
(the global experts [e_start, e_start + E_local)), K top-k.

Two swappable parts, both plain attributes chosen at build time (never by control flow in forward):
  experts_fn  (x_TD, idx_TK, w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, e_start=) -> y_TD over the LOCAL experts;
              model.moe.impl picks trainer.moe.reference.experts_reference or kernels.moe.fast_experts
              (auto: the kernels for CUDA tensors); model.moe.precision=fp8 binds fast_experts' precision (the
              layer then refuses to be built on anything but an sm90 GPU); model.moe.cuda_graph binds the layer's
              own kernels.moe_graph.ExpertGraphs.
  dispatcher  (x_TD, idx_TK, w_TK, layer) -> y_TD. `local_dispatch` runs every expert here (EP=1); expert
              parallelism (trainer/parallel) installs all-gather or all-to-all dispatchers that move tokens
              between EP ranks and call layer.experts_fn on the tokens routed to this rank's experts.
The aux and z losses and the load counts are computed from this rank's own routing, before dispatch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

import torch
from torch import nn

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.errors import ConfigError
from moe_launch.trainer.moe.losses import expert_counts, load_balancing_loss, router_z_loss
from moe_launch.trainer.moe.reference import experts_reference
from moe_launch.trainer.moe.router import Router
from moe_launch.trainer.tracking.steplog import LOGGER

if TYPE_CHECKING:
    from moe_launch.kernels.moe_graph import ExpertGraphs

ExpertsFn = Callable[..., torch.Tensor]


@dataclass
class RouterStats:
    aux_loss: torch.Tensor  # scalar, unweighted (the model applies model.moe.aux_loss_coef)
    z_loss: torch.Tensor  # scalar, unweighted
    counts_E: torch.Tensor  # int64 [E global], no gradient


def resolve_experts_fn(impl: str, precision: str = "bf16", fuse_grads: bool = False,
                       graphs: "ExpertGraphs | None" = None, grouped_gemm: str = "auto") -> ExpertsFn:
    """fuse_grads: model.moe.grad_accumulation_fusion, for the kernels (the reference lets autograd accumulate).
    graphs: the layer's CUDA graphs of the kernels' expert stage (model.moe.cuda_graph). grouped_gemm:
    model.moe.grouped_gemm, the kernels' gemm_impl."""
    if impl == "reference":
        return experts_reference
    kwargs = {k: v for k, v in (("fuse_grad_accumulation", fuse_grads), ("graphs", graphs),
                                ("gemm_impl", None if grouped_gemm == "auto" else grouped_gemm))
              if v not in (False, None)}
    if impl == "auto" and precision == "bf16":
        return functools.partial(auto_experts, **kwargs) if kwargs else auto_experts
    try:  # imported lazily: the Triton kernels are optional and need a GPU (or TRITON_INTERPRET=1)
        from moe_launch.kernels.moe import fast_experts
    except ImportError as e:
        key = "model.moe.impl" if precision == "bf16" else "model.moe.precision"
        raise ConfigError(key, f"the FastSparseMoE kernels cannot be imported ({e})",
                          "install the kernels (triton), or use model.moe.impl=reference with precision=bf16") from e
    if precision != "bf16":
        kwargs["precision"] = precision
    return functools.partial(fast_experts, **kwargs) if kwargs else fast_experts


def expert_weight_scope(cfg: ModelConfig, passes: int, recompute: list[str]) -> Callable[[], ContextManager]:
    """What the trainer opens around each step's forward and backward passes: with FP8 experts and
    model.moe.fp8_weight_reuse, a scope that quantizes each expert weight once per step where a layer runs more than
    once in it (`passes` micro-batches; `recompute` re-running the experts' forward), each copy dropped at its last
    use in the step, else nothing."""
    moe = cfg.moe
    if cfg.kind != "moe" or moe.precision != "fp8" or not moe.fp8_weight_reuse:
        return contextlib.nullcontext
    from moe_launch.kernels.fp8_weights import operands_to_reuse, reuse_weights

    keep = operands_to_reuse(passes, forward_recomputed=bool({"moe", "full"} & set(recompute)))
    return functools.partial(reuse_weights, keep) if keep else contextlib.nullcontext


def check_precision(precision: str, device: torch.device) -> None:
    """FP8 experts need torch._scaled_grouped_mm on an sm90 GPU: refuse any other device before building."""
    if precision != "fp8":
        return
    from moe_launch.kernels.fp8 import fp8_gemm_supported

    if not fp8_gemm_supported(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise ConfigError("model.moe.precision", f"fp8 needs an sm90 (Hopper) GPU with torch._scaled_grouped_mm; "
                          f"this layer is built on {device} ({name}, torch {torch.__version__})",
                          "set model.moe.precision=bf16, or run on H100/H200")


def slow_expert_sizes(cfg: ModelConfig, element_size: int) -> list[str]:
    """The sizes that keep the expert GEMMs off torch's CUTLASS grouped GEMM, whose operands' rows must be a multiple
    of 16 bytes (at `element_size` bytes per element): those GEMMs then run in our Triton kernel, several times
    slower (kernels/grouped_gemm.py). Pure."""
    step = 16 // element_size
    sizes = (("model.d_model", cfg.d_model), ("model.moe.expert_hidden", cfg.moe.expert_hidden))
    return [f"{key}={size}" for key, size in sizes if size % step]


def warn_slow_expert_sizes(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Say so once, at build time, where the CUTLASS path would otherwise run: bf16 on an sm90 GPU."""
    if (cfg.kind != "moe" or dtype != torch.bfloat16 or device.type != "cuda"
            or torch.cuda.get_device_capability(device)[0] < 9):
        return
    slow = slow_expert_sizes(cfg, dtype.itemsize)
    if slow:
        step = 16 // dtype.itemsize
        logging.getLogger(LOGGER).warning(
            f"{', '.join(slow)}: not a multiple of {step}, so the expert GEMMs cannot use torch's CUTLASS grouped "
            f"GEMM and run in the Triton fallback, several times slower; multiples of {step} avoid that")


def auto_experts(x_TD: torch.Tensor, *args, fuse_grad_accumulation: bool = False,
                 graphs: "ExpertGraphs | None" = None, gemm_impl: str = "auto", **kwargs) -> torch.Tensor:
    """model.moe.impl=auto: the FastSparseMoE kernels on CUDA tensors, the torch reference on anything else (the
    kernels run on CPU only through Triton's slow interpreter)."""
    if x_TD.is_cuda:
        from moe_launch.kernels.moe import fast_experts
        return fast_experts(x_TD, *args, fuse_grad_accumulation=fuse_grad_accumulation, graphs=graphs,
                            gemm_impl=gemm_impl, **kwargs)
    return experts_reference(x_TD, *args, **kwargs)


def expert_graphs(cfg: MoEConfig, ep_size: int = 1) -> "ExpertGraphs | None":
    """model.moe.cuda_graph: a layer's capture-and-replay of its expert stage (kernels/moe_graph.py), or None. auto
    gives one that graphs small calls only, and none where the experts are not the bf16 kernels or where the calls
    change shape every step (the alltoall dispatcher's received rows): a graph per shape seen would only be captured,
    held, and rarely replayed."""
    varying_shapes = ep_size > 1 and cfg.dispatcher == "alltoall"
    if cfg.cuda_graph == "false" or (cfg.cuda_graph == "auto" and (cfg.impl == "reference" or cfg.precision != "bf16"
                                                                   or varying_shapes)):
        return None
    from moe_launch.kernels.moe_graph import AUTO_MAX_FLOPS, ExpertGraphs
    return ExpertGraphs(max_flops=AUTO_MAX_FLOPS if cfg.cuda_graph == "auto" else None)


def local_dispatch(x_TD: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor, layer: "MoELayer") -> torch.Tensor:
    """No expert parallelism: this rank owns every expert its tokens are routed to."""
    return layer.experts_fn(x_TD, idx_TK, w_TK, layer.w_gate_EFD, layer.w_up_EFD, layer.w_down_EDF,
                            e_start=layer.e_start)


class MoELayer(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        check_precision(cfg.precision, torch.get_default_device())  # the device build_model allocates on
        if cfg.num_experts % ep_size != 0:
            raise ConfigError("parallel.ep", f"{cfg.num_experts} experts cannot be split over ep={ep_size}",
                              "choose parallel.ep dividing model.moe.num_experts")
        E_local = cfg.num_experts // ep_size
        self.num_experts, self.num_local_experts, self.top_k = cfg.num_experts, E_local, cfg.top_k
        self.e_start = ep_rank * E_local
        self.router = Router(d_model, cfg)
        self.w_gate_EFD = nn.Parameter(torch.empty(E_local, cfg.expert_hidden, d_model))
        self.w_up_EFD = nn.Parameter(torch.empty(E_local, cfg.expert_hidden, d_model))
        self.w_down_EDF = nn.Parameter(torch.empty(E_local, d_model, cfg.expert_hidden))
        for p in (self.w_gate_EFD, self.w_up_EFD, self.w_down_EDF):
            p._moe_expert = True  # optimizers and checkpoints treat expert weights as EP-sharded
        # the CUDA graphs read this layer's weights by address: one set per layer
        self.expert_graphs = expert_graphs(cfg, ep_size)
        self.experts_fn: ExpertsFn = resolve_experts_fn(cfg.impl, cfg.precision, cfg.grad_accumulation_fusion,
                                                        self.expert_graphs, cfg.grouped_gemm)
        self.dispatcher = local_dispatch

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        r = self.router(x_TD)  # fp32 whatever the input
        device_type = x_TD.device.type
        if torch.is_autocast_enabled(device_type):
            # the residual stream stays fp32 under autocast, but the experts' matmuls come out in the autocast
            # dtype and the combine (index_add, grouped GEMM epilogues) needs one dtype: run the experts in it
            x_TD = x_TD.to(torch.get_autocast_dtype(device_type))
        counts_E = expert_counts(r.idx_TK, self.num_experts)
        stats = RouterStats(aux_loss=load_balancing_loss(r.probs_TE, counts_E), z_loss=router_z_loss(r.logits_TE),
                            counts_E=counts_E)
        y_TD = self.dispatcher(x_TD, r.idx_TK, r.w_TK, self)
        return y_TD.view_as(x_BSD), stats
