"""On the GPU, reading a logged step's values back does not wait for device work queued after their copy (a second
of sleep kernel stands in for the optimizer update). Run by test_step_stats.py in a process with the host's GPU;
prints "ok step stats", exits non-zero on a failure."""

from __future__ import annotations

import torch
from test_step_stats import _step

from moe_launch.trainer.step_stats import start_copy


def main() -> None:
    mean_P, per_layer, counts_LE = _step("cuda")
    pending = start_copy(mean_P, per_layer, counts_LE)
    torch.cuda._sleep(2_000_000_000)
    s = pending.get()
    assert not torch.cuda.current_stream().query(), "get() waited for work queued after the copy"
    assert s.mean_P[0] == 3.5
    torch.cuda.synchronize()
    print("ok step stats")


if __name__ == "__main__":
    main()
