"""benchmarks/pp_train.py in its tiny CPU mode under torchrun (2 gloo ranks): the script runs every schedule and
reports sane numbers (the device run is the lead's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers_net import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_pp_benchmark_cpu_mode(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "benchmarks" / "pp_train.py"), "--cpu", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "pp_train.json").read_text())["rows"]
    assert [(r["schedule"], r["virtual_stages"]) for r in rows] == [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 <= r["bubble_measured"] < 1
    # theory from the simulator: (P-1)/(M+P-1) = 1/5 for P=2, M=4 without interleaving; less with it
    assert abs(rows[0]["bubble_theory"] - rows[1]["bubble_theory"]) < 0.1
    assert rows[2]["bubble_theory"] < rows[1]["bubble_theory"]
    assert "| 1f1b | [2, 2] | 4 |" in proc.stdout
