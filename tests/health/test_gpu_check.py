"""The compute check on CPU (the same code runs on GPUs): known answer, checksum, corruption detection."""

from __future__ import annotations

import torch

from moe_launch.health.gpu_check import compute_check, known_operands, verify_product


def test_cpu_compute_check_passes():
    out = compute_check(torch.device("cpu"), size=128, iters=2)
    assert out.ok, out.reasons
    assert out.device_name == "cpu" and out.dtype == "bfloat16" and out.tflops > 0
    assert out.max_rel_err <= 2**-7 and out.checksum_rel_err <= 2**-7


def test_corrupted_product_is_caught():
    a, b = known_operands(96, torch.device("cpu"), torch.bfloat16)
    c = a @ b
    assert max(verify_product(a, b, c)) < 2**-7
    bad = c.clone()
    bad[41, 17] += 64  # one flipped element in a row the sample does not hit: the checksum still sees it
    _, checksum = verify_product(a, b, bad, sample_rows=2)
    assert checksum > 2**-7
    bad_row = c.clone()
    bad_row[0, 5] = -bad_row[0, 5] - 8
    max_rel, _ = verify_product(a, b, bad_row)
    assert max_rel > 2**-7
