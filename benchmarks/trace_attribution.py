"""Where a profiled step's device idle time and chosen kernels come from, read from a torch.profiler chrome trace.

    attribute(trace, roots)   pure: the trace as loaded from export_chrome_trace (a dict), the source folders whose
                              Python frames count as "ours" (deepest such frame names the place)

Device idle: the gaps between consecutive GPU activities (kernels, copies, fills; all streams merged). A gap means
the host was late to launch what ran next, so it is charged to the thread that launched that next activity and to
what that thread was doing at the gap's middle: the deepest of our Python frames there and the deepest torch op.
Kernels by origin: GPU time of the activities whose names match `kinds` (copies by default), charged to the deepest
of our frames on the launching thread at launch time. Needs a trace recorded with with_stack=True (python_function
events); without them the places read "?".
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
COPY_KINDS = r"Memcpy|copy_kernel|direct_copy"


class _Intervals:
    """Nested [ts, ts+dur) events of one thread: the deepest one containing a time."""

    def __init__(self, events: list[dict]):
        self.ev = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
        self.starts = [e["ts"] for e in self.ev]

    def deepest(self, t: float) -> dict | None:
        i = bisect.bisect_right(self.starts, t) - 1
        # events are nested: walk back to the latest-starting one that still contains t (bounded search)
        for j in range(i, max(-1, i - 5000), -1):
            e = self.ev[j]
            if e["ts"] <= t < e["ts"] + e.get("dur", 0):
                return e
        return None


def _place(name: str, roots: tuple[str, ...]) -> str:
    for r in roots:
        k = name.find(r)
        if k >= 0:
            return name[k + len(r):].lstrip("/")
    return name


def attribute(trace: dict, roots: tuple[str, ...], kinds: str = COPY_KINDS, min_gap_us: float = 5.0,
              top: int = 15) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launch_of = {e["args"]["correlation"]: e for e in events
                 if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    frames_by_tid, ops_by_tid = defaultdict(list), defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and any(r in e["name"] for r in roots):
            frames_by_tid[e["tid"]].append(e)
        elif e.get("cat") == "cpu_op":
            ops_by_tid[e["tid"]].append(e)
    frames = {t: _Intervals(v) for t, v in frames_by_tid.items()}
    ops = {t: _Intervals(v) for t, v in ops_by_tid.items()}

    def where(tid, t: float) -> tuple[str, str]:
        f = frames[tid].deepest(t) if tid in frames else None
        o = ops[tid].deepest(t) if tid in ops else None
        return (_place(f["name"], roots) if f else "?"), (o["name"] if o else "-")

    idle = defaultdict(lambda: [0.0, 0])
    busy_end, total_idle = None, 0.0
    for e in gpu:
        if busy_end is not None and e["ts"] - busy_end >= min_gap_us:
            gap = e["ts"] - busy_end
            total_idle += gap
            launch = launch_of.get(e.get("args", {}).get("correlation"))
            key = where(launch["tid"], busy_end + gap / 2) if launch else ("?", "-")
            idle[key][0] += gap
            idle[key][1] += 1
        end = e["ts"] + e.get("dur", 0)
        busy_end = end if busy_end is None else max(busy_end, end)
    span = (busy_end - gpu[0]["ts"]) if gpu else 0.0
    origin = defaultdict(lambda: [0.0, 0])
    pat = re.compile(kinds)
    for e in gpu:
        if pat.search(e["name"]):
            launch = launch_of.get(e.get("args", {}).get("correlation"))
            key = (where(launch["tid"], launch["ts"])[0] if launch else "?", e["name"][:60])
            origin[key][0] += e.get("dur", 0)
            origin[key][1] += 1

    def table(d):
        return [{"place": k[0], "what": k[1], "ms": round(v[0] / 1e3, 3), "count": v[1]}
                for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]

    return {"span_ms": span / 1e3, "idle_ms": total_idle / 1e3, "idle": table(idle), "kernels_by_origin": table(origin)}
