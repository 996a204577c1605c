"""Resume the optimizer from a checkpoint of trainer/checkpoint written under another DP size or sharding strategy.

`trainer/checkpoint/layout.py` names the optimizer file of each saved rank; `reshard.py` decides which saved ranks
hold the pieces of this rank's shards. This is the adapter between the two: the trainer calls
`load_optimizer_resharded(ckpt_dir, opt, saved_layout)` when the saved `layout` differs from the run's in `dp`
(or `optimizer_sharding`) only. A pipelined checkpoint (saved pp > 1) names its files as trainer/pipeline/ckpt.py
does (`optim/pp<p>-ep<e>.pt` for optimizer_sharding=none); the shards themselves are per stage, so resharding is
within each stage (pp itself cannot change).
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
from moe_launch.trainer.pipeline import ckpt as stage_ckpt


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


def saved_optimizer_file(saved_rank: int, saved_layout: dict[str, Any]) -> str:
    """The optimizer file that `saved_rank` wrote under `saved_layout`, in the naming of the code that wrote it."""
    if saved_layout.get("pp", 1) == 1:
        return layout.optimizer_file(saved_rank_coords(saved_rank, saved_layout))
    dp, ep = saved_layout["dp"], saved_layout["ep"]
    pp_rank, dp_rank, ep_rank = coords_of(saved_rank, dp, ep)
    return stage_ckpt.optimizer_file(stage_ckpt.StageCoords(
        rank=saved_rank, pp_rank=pp_rank, dp_rank=dp_rank, dp_size=dp, ep_rank=ep_rank, ep_size=ep,
        optimizer_sharding=saved_layout["optimizer_sharding"], is_moe=True))


def load_optimizer_resharded(ckpt_dir: Path, opt: ShardedAdamW, saved_layout: dict[str, Any]) -> None:
    """Collective-free: each rank reads only the saved optimizer files that overlap its own shards."""

    def read(saved_rank: int) -> dict:
        return load_file(Path(ckpt_dir), saved_optimizer_file(saved_rank, saved_layout))

    reshard_optimizer_state(opt, saved_layout, read)
