"""Choose the EP token exchange by `model.moe.dispatcher` and install it on every MoE layer of a model.

The MoE layer (trainer/moe/layer.py) calls `layer.dispatcher(x_TD, idx_TK, w_TK, layer) -> y_TD`; with ep = 1 the
layer's own `local_dispatch` stays in place (no exchange needed).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from moe_launch.errors import ConfigError
from moe_launch.trainer.parallel.dispatch_allgather import AllGatherDispatch
from moe_launch.trainer.parallel.dispatch_alltoall import AllToAllDispatch
from moe_launch.trainer.parallel.groups import Axis, Groups

DISPATCHERS: dict[str, Callable[[Axis], Any]] = {"allgather": AllGatherDispatch, "alltoall": AllToAllDispatch}


def make_dispatcher(name: str, ep: Axis) -> Any:
    if name not in DISPATCHERS:
        raise ConfigError("model.moe.dispatcher", f"got {name!r}", f"use one of {', '.join(DISPATCHERS)}")
    return DISPATCHERS[name](ep)


def _dispatcher_name(cfg: Any) -> str:
    """Accepts the root config, the model config, the MoE config, or the dispatcher name itself."""
    if isinstance(cfg, str):
        return cfg
    for path in (("model", "moe"), ("moe",), ()):
        node = cfg
        for attr in path:
            node = getattr(node, attr, None)
        if node is not None and isinstance(getattr(node, "dispatcher", None), str):
            return node.dispatcher
    raise TypeError(f"cannot find model.moe.dispatcher in {type(cfg).__name__}")


def attach_dispatchers(model: nn.Module, cfg: Any, groups: Groups) -> int:
    """Set `dispatcher` on every MoE layer (a module with `experts_fn` and `e_start`). Returns how many were set.
    Checks that each layer's expert range is the one this EP rank owns, so a model built for another EP layout fails
    here rather than computing with the wrong experts."""
    if groups.ep_size == 1:
        return 0
    dispatcher = make_dispatcher(_dispatcher_name(cfg), groups.ep)
    count = 0
    for name, module in model.named_modules():
        if hasattr(module, "experts_fn") and hasattr(module, "e_start"):
            e_local = module.w_gate_EFD.shape[0]
            if module.num_experts != e_local * groups.ep_size or module.e_start != groups.ep_rank * e_local:
                raise ConfigError(
                    "parallel.ep",
                    f"layer {name} holds experts [{module.e_start}, {module.e_start + e_local}) of "
                    f"{module.num_experts}, not EP rank {groups.ep_rank}'s share of ep={groups.ep_size}",
                    "build the model with build_model(cfg, ep_rank=groups.ep_rank, ep_size=groups.ep_size)",
                )
            module.dispatcher = dispatcher
            count += 1
    return count
