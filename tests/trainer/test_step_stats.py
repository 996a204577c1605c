"""A logged step's values are copied to the host ahead of the optimizer update and read without waiting for it."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_gpu import host_has_gpu, run_on_host_gpu

from moe_launch.trainer.step_stats import start_copy


def _parts(aux, z, counts):
    return SimpleNamespace(aux_per_layer=[torch.tensor(a) for a in aux], z_per_layer=[torch.tensor(v) for v in z],
                           counts_per_layer=[torch.tensor(c) for c in counts])


def _step(device="cpu"):
    mean_P = torch.tensor([3.5, 3.0, 0.4, 0.1], dtype=torch.float64, device=device)
    per_layer = [_parts([1.0, 2.0], [0.5, 0.25], [[3, 1], [2, 2]]), _parts([3.0, 4.0], [1.5, 0.75], [[0, 4], [1, 3]])]
    for p in per_layer:
        for key in ("aux_per_layer", "z_per_layer", "counts_per_layer"):
            setattr(p, key, [t.to(device) for t in getattr(p, key)])
    counts_LE = torch.tensor([[3 + 2**40, 5], [3, 5]], dtype=torch.int64, device=device)
    return mean_P, per_layer, counts_LE


def test_values_are_the_step_means_and_exact_counts():
    mean_P, per_layer, counts_LE = _step()
    s = start_copy(mean_P, per_layer, counts_LE).get()
    assert s.mean_P == [3.5, 3.0, 0.4, 0.1]
    assert s.aux_L == [2.0, 3.0] and s.z_L == [1.0, 0.5]  # means over the two micro-batches
    assert s.counts_LE.dtype == torch.int64 and s.counts_LE.tolist() == [[3 + 2**40, 5], [3, 5]]


def test_values_are_those_at_the_copy_not_after_later_updates():
    mean_P, per_layer, counts_LE = _step()
    pending = start_copy(mean_P, per_layer, counts_LE)
    mean_P.add_(100.0)  # what the update would do to device tensors queued after the copy
    counts_LE.zero_()
    s = pending.get()
    assert s.mean_P[0] == 3.5 and s.counts_LE[0, 1] == 5


def test_dense_model_has_no_layers_and_no_counts():
    mean_P, _, _ = _step()
    s = start_copy(mean_P, [SimpleNamespace(aux_per_layer=[], z_per_layer=[], counts_per_layer=[])], None).get()
    assert s.aux_L == [] and s.z_L == [] and s.counts_LE is None


@pytest.mark.skipif(not host_has_gpu(), reason="needs a CUDA device")
def test_reading_back_does_not_wait_for_work_queued_after_the_copy():
    """gpu_step_stats.py in a process with the host's GPU (the suite's own processes see none)."""
    assert run_on_host_gpu(Path(__file__).with_name("gpu_step_stats.py")).startswith("ok step stats")
