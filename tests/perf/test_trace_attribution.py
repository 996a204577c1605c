"""benchmarks/trace_attribution.py on a hand-made trace: device gaps are charged to what the launching thread was
doing in the gap, copies to the frame that launched them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from trace_attribution import attribute  # noqa: E402

ROOT = "/repo/"


def ev(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_gaps_and_copies_are_charged_to_their_places():
    trace = {"traceEvents": [
        # host thread 1: a step whose optimizer reads the norm back (a sync) before launching the update
        ev("python_function", "/repo/trainer/loop.py(10): step", 0, 1000),
        ev("python_function", "/repo/trainer/parallel/optimizer.py(284): grad_norm", 100, 400),
        ev("python_function", "/usr/lib/python3/threading.py(1): wait", 150, 300),  # not ours: ignored
        ev("cpu_op", "aten::_local_scalar_dense", 150, 340),
        ev("cuda_runtime", "cudaLaunchKernel", 50, 5, correlation=1),
        ev("cuda_runtime", "cudaLaunchKernel", 495, 5, correlation=2),
        # backward thread 2 launches a copy from the layer's backward
        ev("python_function", "/repo/kernels/moe.py(80): backward", 600, 200, tid=2),
        ev("cuda_runtime", "cudaMemcpyAsync", 610, 5, tid=2, correlation=3),
        # the device: kernel 1 ends at 200, kernel 2 starts at 500 (300 us idle), the copy runs right after
        ev("kernel", "norm_kernel", 60, 140, tid=7, correlation=1),
        ev("kernel", "adamw_kernel", 500, 100, tid=7, correlation=2),
        ev("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 600, 30, tid=7, correlation=3),
    ]}
    got = attribute(trace, (ROOT,))
    assert got["idle_ms"] == 0.3 and got["span_ms"] == 0.57
    assert got["idle"] == [{"place": "trainer/parallel/optimizer.py(284): grad_norm",
                            "what": "aten::_local_scalar_dense", "ms": 0.3, "count": 1}]
    assert got["kernels_by_origin"] == [{"place": "kernels/moe.py(80): backward",
                                         "what": "Memcpy DtoD (Device -> Device)", "ms": 0.03, "count": 1}]


def test_overlapping_streams_leave_no_gap():
    trace = {"traceEvents": [ev("kernel", "a", 0, 100, correlation=1), ev("kernel", "b", 50, 10, correlation=2),
                             ev("kernel", "c", 101, 10, correlation=3)]}  # c starts 1 us after a ends: below 5 us
    got = attribute(trace, (ROOT,))
    assert got["idle_ms"] == 0 and got["idle"] == [] and got["kernels_by_origin"] == []
