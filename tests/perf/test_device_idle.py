"""benchmarks/device_idle.py on hand-built profiler traces: which gaps count as idle and what they are charged to."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from device_idle import idle_gaps  # noqa: E402


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": {}}
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def test_gaps_are_charged_to_the_late_launch_the_early_launch_and_the_sync():
    events = [
        # host: a forward op launching k1 and k2, then a blocking read, then an op that launches k3 late
        _x("cpu_op", "fwd", 0, 120), _x("cpu_op", "aten::mm", 1, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 2, 1, corr=1),
        _x("cuda_runtime", "cudaLaunchKernel", 4, 1, corr=2),
        _x("cpu_op", "aten::item", 20, 40), _x("cuda_runtime", "cudaStreamSynchronize", 21, 38),
        _x("cuda_runtime", "cudaLaunchKernel", 62, 1, corr=3),
        _x("cpu_op", "slow_python_op", 80, 30), _x("cuda_runtime", "cudaLaunchKernel", 105, 1, corr=4),
        # device: k1 10..20, k2 22..30 (2 us gap below the threshold), k3 64..70 (gap 34 us across the sync),
        # k4 106..120 (gap 36 us: launched late)
        _x("kernel", "k1", 10, 10, tid=7, corr=1), _x("kernel", "k2", 22, 8, tid=7, corr=2),
        _x("kernel", "k3", 64, 6, tid=7, corr=3), _x("kernel", "k4", 106, 14, tid=7, corr=4),
    ]
    r = idle_gaps({"traceEvents": events}, min_gap_us=5)
    assert r["gaps"] == 2
    assert abs(r["idle_ms"] - 0.070) < 1e-9 and abs(r["busy_ms"] - 0.038) < 1e-9
    causes = {c["cause"]: c["ms"] for c in r["by_cause"]}
    assert causes == {"host sync cudaStreamSynchronize in fwd > aten::item": 0.034,
                      "host late: fwd > slow_python_op": 0.036}


def test_work_launched_before_the_gap_waits_on_something_else():
    events = [_x("cuda_runtime", "cudaLaunchKernel", 0, 1, corr=1),
              _x("cuda_runtime", "cudaLaunchKernel", 1, 1, corr=2),
              _x("kernel", "a", 5, 5, tid=7, corr=1), _x("kernel", "b", 30, 5, tid=7, corr=2)]
    r = idle_gaps({"traceEvents": events})
    assert [c["cause"] for c in r["by_cause"]] == ["launched before the gap (waits on a stream/event): b"]
    assert r["window_ms"] == 0.030
