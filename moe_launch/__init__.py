"""moe-launch: pretrain Mixture-of-Experts language models on Slurm.

Subpackages live in the repository's top-level folders (see setup.py): `moe_launch.orchestrator`,
`moe_launch.trainer`, `moe_launch.kernels`, `moe_launch.health`, `moe_launch.conf`.
"""

import sys
from pathlib import Path

__version__ = "0.1.0"


def _drop_checkout_root(path: list[str], root: Path) -> list[str]:
    """sys.path without the root of this source checkout. `python -m ...` (the trainer, the supervisor, pytest)
    started in the checkout puts its root first, and there the top-level folders that are this package's subpackages
    would be found as top-level packages of their own: `kernels/` shadows the Hugging Face `kernels` package that
    transformers (5.25 on) imports. Nothing here is imported through the root: setup.py maps the folders onto
    `moe_launch`. `root`: the folder holding this package; an installed copy (no setup.py there) leaves sys.path
    alone."""
    if not ((root / "setup.py").is_file() and (root / "kernels" / "moe.py").is_file()):
        return path
    return [p for p in path if Path(p or ".").resolve() != root]


sys.path[:] = _drop_checkout_root(sys.path, Path(__file__).resolve().parent.parent)
