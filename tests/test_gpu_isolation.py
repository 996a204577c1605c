"""The suite's processes see no GPU on any host, and a GPU test's child gets the host's devices back
(tests/helpers_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import helpers_gpu
import torch


def test_the_suite_sees_no_gpu_and_remembers_what_the_host_had():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
    assert helpers_gpu.SAVED_KEY in os.environ


def test_a_child_of_a_gpu_test_gets_the_hosts_devices_back(monkeypatch):
    monkeypatch.setenv(helpers_gpu.SAVED_KEY, "2,3")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env = helpers_gpu.host_gpu_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and "TRITON_INTERPRET" not in env and helpers_gpu.SAVED_KEY not in env
    monkeypatch.setenv(helpers_gpu.SAVED_KEY, helpers_gpu.UNSET)  # the host never set it: the child sees every GPU
    assert "CUDA_VISIBLE_DEVICES" not in helpers_gpu.host_gpu_env()


def test_hiding_twice_keeps_what_the_host_had(monkeypatch):
    monkeypatch.setenv(helpers_gpu.SAVED_KEY, "1")
    helpers_gpu.hide_host_gpus()  # an xdist worker imports the conftest again
    assert os.environ[helpers_gpu.SAVED_KEY] == "1" and os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_a_gpu_tests_script_imports_the_suites_helpers(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import helpers_gpu, helpers_net\nprint('ok')\n")
    proc = subprocess.run([sys.executable, str(script)], env=helpers_gpu.host_gpu_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-2000:]
