"""moe-launch: pretrain Mixture-of-Experts language models on Slurm.

Subpackages live in the repository's top-level folders (see setup.py): `moe_launch.orchestrator`,
`moe_launch.trainer`, `moe_launch.kernels`, `moe_launch.health`, `moe_launch.conf`.
"""

__version__ = "0.1.0"
