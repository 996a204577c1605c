"""Where the GPU waits during a step: idle gaps in a torch.profiler chrome trace, and the host syncs a step makes.

    report = idle_gaps(trace_json, min_gap_us=5)   gaps between the device's kernels, grouped by cause
    sites = sync_sites(step_fn)                     stacks of the operations that synchronise with the host

A gap is charged to what the host was doing when it launched the work that ended the gap: the chain of CPU ops
enclosing that launch (innermost last). If that launch came before the gap opened, the device was not waiting for the
host but for another stream or an event, and the gap says so. Host syncs inside the gap (cudaStreamSynchronize, a
blocking copy) are named too. The profiler runs without stack tracing: the Python tracer slows the host enough to
make gaps that are not there without it.

CPU smoke test: tests/perf/test_device_idle.py builds a trace by hand and checks the attribution.
"""

from __future__ import annotations

import bisect
import collections
import json
import traceback
import warnings
from typing import Callable

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _is_sync(name: str) -> bool:
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpy")


def _enclosing(ops_by_tid: dict, tid, ts: float, depth: int) -> str:
    """Names of the CPU ops on thread `tid` that contain time ts, outermost first, the innermost `depth` kept."""
    starts, ops = ops_by_tid.get(tid, ([], []))
    chain = [o for o in ops[:bisect.bisect_right(starts, ts)] if o["ts"] + o.get("dur", 0) >= ts]
    chain.sort(key=lambda o: (o["ts"], -o.get("dur", 0)))
    return " > ".join(o["name"][:60] for o in chain[-depth:]) or "(no CPU op)"


def idle_gaps(trace: dict | str, min_gap_us: float = 5.0, depth: int = 3, top: int = 20) -> dict:
    """Idle time between the device's kernels over the traced window, grouped by the cause described above."""
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    syncs = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and _is_sync(e["name"])),
                   key=lambda e: e["ts"])
    ops_by_tid: dict = {}
    for e in sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation")), key=lambda e: e["ts"]):
        starts, ops = ops_by_tid.setdefault(e["tid"], ([], []))
        starts.append(e["ts"])
        ops.append(e)
    if not gpu:
        return {"window_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": 0, "by_cause": []}
    busy_end, busy, idle = gpu[0]["ts"] + gpu[0]["dur"], gpu[0]["dur"], 0.0
    causes: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu[1:]:
        gap = e["ts"] - busy_end
        if gap >= min_gap_us:
            idle += gap
            launch = launches.get(e.get("args", {}).get("correlation"))
            sync = next((s for s in syncs if s["ts"] < e["ts"] and s["ts"] + s["dur"] > busy_end), None)
            if sync is not None:
                cause = f"host sync {sync['name']} in {_enclosing(ops_by_tid, sync['tid'], sync['ts'], depth)}"
            elif launch is None:
                cause = "(launch not traced)"
            elif launch["ts"] <= busy_end:
                cause = f"launched before the gap (waits on a stream/event): {e['name'][:60]}"
            else:
                cause = f"host late: {_enclosing(ops_by_tid, launch['tid'], launch['ts'], depth)}"
            causes[cause][0] += 1
            causes[cause][1] += gap
        busy += max(0.0, e["ts"] + e["dur"] - max(busy_end, e["ts"]))
        busy_end = max(busy_end, e["ts"] + e["dur"])
    window = busy_end - gpu[0]["ts"]
    ranked = sorted(causes.items(), key=lambda kv: -kv[1][1])[:top]
    return {"window_ms": window / 1e3, "busy_ms": busy / 1e3, "idle_ms": idle / 1e3,
            "gaps": sum(n for n, _ in causes.values()),
            "by_cause": [{"cause": c, "gaps": n, "ms": round(us / 1e3, 3)} for c, (n, us) in ranked]}


def sync_sites(step_fn: Callable[[], object], depth: int = 10) -> list[dict]:
    """Run step_fn once with torch's CUDA sync debug mode on; the distinct Python stacks that synchronised."""
    import torch

    seen: collections.Counter = collections.Counter()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                seen["".join(traceback.format_stack(limit=depth)[:-2])] += 1
            else:
                original(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step_fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = original
    return [{"count": n, "stack": s} for s, n in seen.most_common()]
