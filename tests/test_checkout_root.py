"""The checkout's top-level folders are moe_launch's subpackages, never top-level packages of their own: with the
checkout as the working directory of `python -m ...` (how the trainer, the supervisor and pytest start), importing
moe_launch takes the checkout root off sys.path, so that `import kernels` finds the Hugging Face package that
transformers imports (or nothing), not our kernels/ folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = ("import importlib.util, sys; import moe_launch; spec = importlib.util.find_spec('kernels'); "
         "print(spec.origin if spec else None)")


def test_the_checkout_root_does_not_shadow_top_level_packages():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    origin = out.stdout.strip()
    assert origin == "None" or not Path(origin).resolve().is_relative_to(REPO / "kernels"), origin


def test_the_package_still_imports_from_the_checkout():
    probe = "import moe_launch.kernels.moe, moe_launch.trainer.moe.layer; print('ok')"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_only_a_checkout_root_is_dropped(tmp_path):
    from moe_launch import _drop_checkout_root

    site = tmp_path / "site"  # an installed copy: moe_launch/ and the HF kernels/ side by side, no setup.py
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "moe.py").write_text("")
    path = [str(site), "/usr/lib/python3"]
    assert _drop_checkout_root(list(path), site) == path
    checkout = tmp_path / "checkout"
    (checkout / "kernels").mkdir(parents=True)
    (checkout / "kernels" / "moe.py").write_text("")
    (checkout / "setup.py").write_text("")
    assert _drop_checkout_root([str(checkout), str(checkout / "kernels"), str(site)], checkout) == [
        str(checkout / "kernels"), str(site)]
