"""benchmarks/health_gpu.py in its tiny CPU mode: the compute check and a 2-rank gloo all-to-all via torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers_net import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_health_gpu_benchmark_cpu_mode(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "benchmarks" / "health_gpu.py"), "--cpu", "--max-bytes", "65536", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compute check" in proc.stdout and "#wrong" in proc.stdout
    record = json.loads(out.read_text())
    assert record["world"] == 2 and record["compute"]["reasons"] == []
    assert [r["bytes"] for r in record["alltoall"]] == [1024, 8192, 65536]
    assert all(r["wrong"] == 0 and r["busbw_gbs"] > 0 for r in record["alltoall"])
