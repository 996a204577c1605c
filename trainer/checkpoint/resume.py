"""Resume under another layout: which resume is possible, and the optimizer reassembled from the saved shards.

`resume_mode(saved, now)` decides from the two layouts ({dp, ep, pp, optimizer_sharding}); for "reshard" (only dp or
optimizer_sharding changed) the trainer calls `load_optimizer_resharded(ckpt_dir, opt, saved_layout)`, which reads
only the saved optimizer files that overlap this rank's shards, named by layout.py for the saved rank's coordinates
(reshard.py decides which saved ranks those are). The model files do not depend on dp, so they load as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_launch.trainer.checkpoint import layout
from moe_launch.trainer.checkpoint.reshard import reshard_optimizer_state
from moe_launch.trainer.checkpoint.store import load_file
from moe_launch.trainer.parallel.groups import coords_of
from moe_launch.trainer.parallel.optimizer import ShardedAdamW


def resume_mode(saved_layout: dict[str, Any], layout_now: dict[str, Any]) -> str:
    """'same' (load each rank's own files); 'reshard' (only dp / optimizer_sharding changed: the model files load as
    they are, the optimizer through `load_optimizer_resharded`); 'relayout' (ep or pp changed: model and optimizer
    reassembled by parameter name, relayout.py)."""
    keys = ("dp", "ep", "pp", "optimizer_sharding")
    if all(saved_layout.get(k, 1) == layout_now.get(k, 1) for k in keys):
        return "same"
    if any(saved_layout.get(k, 1) != layout_now.get(k, 1) for k in ("ep", "pp")):
        return "relayout"
    return "reshard"


def saved_rank_coords(saved_rank: int, saved_layout: dict[str, Any], is_moe: bool = True) -> layout.Coords:
    dp, ep, pp = saved_layout["dp"], saved_layout["ep"], saved_layout.get("pp", 1)
    pp_rank, dp_rank, ep_rank = coords_of(saved_rank, dp, ep)
    return layout.Coords(rank=saved_rank, dp_rank=dp_rank, ep_rank=ep_rank, ep_size=ep,
                         optimizer_sharding=saved_layout["optimizer_sharding"], is_moe=is_moe, dp_size=dp,
                         pp_rank=pp_rank, pp_size=pp)


def saved_optimizer_file(saved_rank: int, saved_layout: dict[str, Any]) -> str:
    """The optimizer file that holds `saved_rank`'s shards under `saved_layout` (optimizer_sharding=none: the file
    its (stage, EP rank) shares with its DP replicas)."""
    return layout.optimizer_file(saved_rank_coords(saved_rank, saved_layout))


def load_optimizer_resharded(ckpt_dir: Path, opt: ShardedAdamW, saved_layout: dict[str, Any]) -> None:
    """Collective-free: each rank reads only the saved optimizer files that overlap its own shards."""

    def read(saved_rank: int) -> dict:
        return load_file(Path(ckpt_dir), saved_optimizer_file(saved_rank, saved_layout))

    reshard_optimizer_state(opt, saved_layout, read)
