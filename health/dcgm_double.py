"""Installs the dcgmi TEST DOUBLE (data/dcgmi_double.sh) for chosen nodes. Used by tests only.

Layout: <root>/<node>/dcgmi (the double), recorded.json (a document from data/), recorded.rc (exit status).
Point `MOE_HEALTH_DCGMI_DIR=<root>` at it; `dcgm.find_dcgmi(node)` then runs the double on that node.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from moe_launch.health.dcgm import DATA_DIR


def install_double(root: Path, node: str, sample: str, returncode: int = 0) -> Path:
    """sample: a file name under health/data (e.g. "dcgm_fail_memory.json"). Returns the double's path."""
    node_dir = Path(root) / node
    node_dir.mkdir(parents=True, exist_ok=True)
    exe = node_dir / "dcgmi"
    shutil.copyfile(DATA_DIR / "dcgmi_double.sh", exe)
    exe.chmod(0o755)
    shutil.copyfile(DATA_DIR / sample, node_dir / "recorded.json")
    (node_dir / "recorded.rc").write_text(f"{returncode}\n")
    return exe
