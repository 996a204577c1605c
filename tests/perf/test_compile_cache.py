"""Compiled code kept in the run directory (trainer/compile.py compile_cache_env): a second process compiling the
same module loads Inductor's generated code from there instead of generating it again. And `train.compile`'s default
follows the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from moe_launch.trainer.compile import compile_cache_env, compile_enabled

# A process that compiles the trainer's RMSNorm (a module train.compile compiles; forward only, to keep the C++ build
# short), then prints Inductor's cache counters.
_CHILD = """
import json, torch
from torch._dynamo.utils import counters
from moe_launch.trainer.model.norm import RMSNorm
torch.set_num_threads(1)
norm = RMSNorm(16, 1e-6)
norm.compile(dynamic=False)
with torch.no_grad():
    norm(torch.randn(4, 16))
print(json.dumps(dict(counters["inductor"])))
"""


def _compile_in_a_new_process(env: dict[str, str]) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_restarted_process_loads_compiled_code_from_the_run_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_CACHE"))}
    env.update(compile_cache_env(tmp_path / "run"), OMP_NUM_THREADS="1")
    first = _compile_in_a_new_process(env)
    assert first.get("fxgraph_cache_miss", 0) > 0 and first.get("fxgraph_cache_hit", 0) == 0, first
    assert any((tmp_path / "run" / "compile_cache" / "inductor").iterdir())
    again = _compile_in_a_new_process(env)  # what a relaunched trainer does
    assert again.get("fxgraph_cache_hit", 0) > 0 and again.get("fxgraph_cache_miss", 0) == 0, again


def test_compile_default_is_on_for_cuda_only():
    assert compile_enabled(None, torch.device("cuda", 0)) is True
    assert compile_enabled(None, torch.device("cpu")) is False
    assert compile_enabled(True, torch.device("cpu")) is True and compile_enabled(False, torch.device("cuda")) is False
