"""Resume the optimizer from a checkpoint of trainer/checkpoint written under another DP size or sharding strategy.

`trainer/checkpoint/layout.py` names the optimizer file of each saved rank; `reshard.py` decides which saved ranks
hold the pieces of this rank's shards. This is the adapter between the two: the trainer calls
`load_optimizer_resharded(ckpt_dir, opt, saved_layout)` when the saved `layout` differs from the run's in `dp`
(or `optimizer_sharding`) only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_launch.errors import CheckpointError
from moe_launch.trainer.checkpoint import layout
from moe_launch.trainer.checkpoint.store import load_file
from moe_launch.trainer.parallel.groups import coords_of
from moe_launch.trainer.parallel.optimizer import ShardedAdamW
from moe_launch.trainer.parallel.reshard import reshard_optimizer_state


def resume_mode(saved_layout: dict[str, Any], layout_now: dict[str, Any]) -> str:
    """'same' (load each rank's own files), 'reshard' (only dp / optimizer_sharding changed: load the optimizer with
    `load_optimizer_resharded`; the model files do not depend on dp). Anything else raises CheckpointError."""
    keys = ("dp", "ep", "pp", "optimizer_sharding")
    if all(saved_layout.get(k, 1) == layout_now.get(k, 1) for k in keys):
        return "same"
    fixed = [k for k in ("ep", "pp") if saved_layout.get(k, 1) != layout_now.get(k, 1)]
    if fixed:
        raise CheckpointError(
            f"the checkpoint was written with {', '.join(f'{k}={saved_layout.get(k, 1)}' for k in fixed)}, this run "
            f"has {', '.join(f'{k}={layout_now.get(k, 1)}' for k in fixed)}: only parallel.dp and "
            "parallel.optimizer_sharding may change on resume; restore parallel.ep / parallel.pp or start from a "
            "model-only checkpoint (model.init_from=ckpt:...)"
        )
    return "reshard"


def saved_rank_coords(saved_rank: int, saved_layout: dict[str, Any], is_moe: bool = True) -> layout.Coords:
    _, dp_rank, ep_rank = coords_of(saved_rank, saved_layout["dp"], saved_layout["ep"])
    return layout.Coords(rank=saved_rank, dp_rank=dp_rank, ep_rank=ep_rank, ep_size=saved_layout["ep"],
                         optimizer_sharding=saved_layout["optimizer_sharding"], is_moe=is_moe)


def load_optimizer_resharded(ckpt_dir: Path, opt: ShardedAdamW, saved_layout: dict[str, Any]) -> None:
    """Collective-free: each rank reads only the saved optimizer files that overlap its own shards."""

    def read(saved_rank: int) -> dict:
        return load_file(Path(ckpt_dir), layout.optimizer_file(saved_rank_coords(saved_rank, saved_layout)))

    reshard_optimizer_state(opt, saved_layout, read)
