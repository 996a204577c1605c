"""Installing the package prints no setuptools warnings and ships what the CLIs need (entry points, health data).

Builds a wheel from a copy of the source tree with the venv's own setuptools (no network, no build isolation)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "moe_launch", "orchestrator", "trainer", "kernels", "health",
           "conf")


def test_wheel_builds_without_warnings_and_ships_data(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if "Warning" in ln and "Location 'file:" not in ln]  # the latter: this machine's pip index config
    assert not noise, noise
    (wheel,) = (tmp_path / "dist").glob("moe_launch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "moe_launch/health/data/dcgm_pass.json" in names and "moe_launch/orchestrator/commands.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert all(cli in text for cli in ("moe-launch =", "moe-health =", "moe-data ="))
