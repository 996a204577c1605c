"""One health-check outcome: the unit that preflight returns, the store appends and the report renders.

status is one of pass | warn | fail | unavailable. `value` is the headline number of the check (busbw GB/s for the
all-to-all, TFLOP/s for the compute check, None for DCGM); `details` keeps everything else a human needs to act.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

STATUSES = ("pass", "warn", "fail", "unavailable")

# checks that a node can fail on its own (the all-to-all judges a group of nodes)
CHECK_DCGM = "dcgm"
CHECK_COMPUTE = "compute"
CHECK_ALLTOALL = "alltoall"
CHECK_ISOLATION = "isolation"
CHECK_TASK = "task"  # the per-node task itself did not report (node unreachable, crashed, timed out)
CHECK_IN_RUN = "in_run"  # blamed by the supervisor during training: node lost, NaN/Inf on its rank, a hang


@dataclass
class CheckResult:
    node: str
    check: str
    status: str
    value: Optional[float] = None
    reasons: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"CheckResult.status {self.status!r} is not one of {STATUSES}")

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CheckResult":
        return cls(
            node=d["node"], check=d["check"], status=d["status"], value=d.get("value"),
            reasons=list(d.get("reasons", [])), details=dict(d.get("details", {})), time=d.get("time", time.time()),
        )
