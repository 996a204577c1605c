"""Maps the design's top-level folders onto the `moe_launch` import package.

`pyproject.toml` holds the metadata; this file only computes the package list, because setuptools'
`package-dir` mapping cannot be combined with automatic discovery of nested packages.
"""

import os

from setuptools import setup

SUBPACKAGES = ("orchestrator", "trainer", "kernels", "health", "conf")


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = ["moe_launch"], {"moe_launch": "moe_launch"}
    for folder in SUBPACKAGES:
        package_dir[f"moe_launch.{folder}"] = folder
        for dirpath, _dirnames, filenames in os.walk(folder):
            if "__init__.py" in filenames:
                packages.append("moe_launch." + dirpath.replace(os.sep, "."))
    return packages, package_dir


packages, package_dir = _packages()
# health/data holds DCGM fixtures and scripts, no Python: listed as a data-only package, which is how setuptools wants
# non-code folders inside a package declared (as package data of moe_launch.health it warns on every build)
packages.append("moe_launch.health.data")
setup(packages=packages, package_dir=package_dir, package_data={"moe_launch.health.data": ["*"]})
