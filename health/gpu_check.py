"""Compute check of one device: a fixed-size bf16 GEMM with a known answer, its TFLOP/s, and (on a GPU) a fill and
read-back of most of the card's free memory.

Known answer: A and B hold integers in {-1, 0, 1} from a fixed seed, so every product is an integer that fp32
accumulation gets exactly; only the final rounding to bf16 may move it, by at most half a bf16 ulp. Two checks:
  * a sample of rows against an fp64 reference (exact), tolerance 2^-7 relative;
  * a checksum over the whole result (Huang-Abraham): column sums of C must equal (column sums of A) @ B, which
    catches a corrupted element anywhere without an fp64 GEMM of the full size.
TFLOP/s = 2·M·N·K·iters / time. On CPU nodes the same code runs small (tests); only GPUs are judged on speed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

GPU_SIZE = 8192
CPU_SIZE = 256


@dataclass
class ComputeOutcome:
    device: str
    device_name: str
    dtype: str
    size: int
    tflops: float
    max_rel_err: float
    checksum_rel_err: float
    mem_gib: float = 0.0
    reasons: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: a CPU-GPU sync point, on purpose (timing)


def known_operands(size: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(1234)
    a_MK = torch.randint(-1, 2, (size, size), generator=g, dtype=torch.int8)
    b_KN = torch.randint(-1, 2, (size, size), generator=g, dtype=torch.int8)
    return a_MK.to(device=device, dtype=dtype), b_KN.to(device=device, dtype=dtype)


def verify_product(a_MK: torch.Tensor, b_KN: torch.Tensor, c_MN: torch.Tensor,
                   sample_rows: int = 64) -> tuple[float, float]:
    """(max relative error on sampled rows vs fp64, relative error of the column-sum checksum)."""
    m = a_MK.shape[0]
    rows = torch.linspace(0, m - 1, min(sample_rows, m)).long().to(a_MK.device)
    ref = a_MK[rows].double() @ b_KN.double()
    got = c_MN[rows].double()
    max_rel = float(((got - ref).abs() / ref.abs().clamp_min(1.0)).max())
    colsum_N = c_MN.double().sum(0)
    expect_N = a_MK.double().sum(0) @ b_KN.double()
    scale = c_MN.double().abs().sum(0).clamp_min(1.0)
    checksum_rel = float(((colsum_N - expect_N).abs() / scale).max())
    return max_rel, checksum_rel


def memory_fill(device: torch.device, fraction: float = 0.85) -> tuple[float, list[str]]:
    """Allocate `fraction` of the free memory, write a pattern, read it back. GPU only."""
    free, _total = torch.cuda.mem_get_info(device)
    nbytes = int(free * fraction)
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return 0.0, [f"could not allocate {nbytes / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free"]
    buf.fill_(0xA5)
    bad = sum(int((chunk != 0xA5).sum()) for chunk in buf.split(1 << 30))
    del buf
    torch.cuda.empty_cache()
    return nbytes / 2**30, ([f"memory read-back: {bad} bytes differ"] if bad else [])


def compute_check(device: torch.device, size: int = 0, iters: int = 10,
                  dtype: torch.dtype = torch.bfloat16, mem_fraction: float = 0.85) -> ComputeOutcome:
    size = size or (GPU_SIZE if device.type == "cuda" else CPU_SIZE)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    a_MK, b_KN = known_operands(size, device, dtype)
    c_MN = a_MK @ b_KN  # warm-up and the product that is verified
    _sync(device)
    max_rel, checksum_rel = verify_product(a_MK, b_KN, c_MN)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a_MK, b_KN, out=c_MN)
    _sync(device)
    seconds = time.perf_counter() - t0
    tflops = 2 * size**3 * iters / seconds / 1e12
    reasons = []
    if max_rel > 2**-7:
        reasons.append(f"GEMM known-answer check: max relative error {max_rel:.3g} on sampled rows (> 2^-7)")
    if checksum_rel > 2**-7:  # bf16 rounding alone stays below 2^-8 of the column's absolute sum
        reasons.append(f"GEMM checksum: column sums off by {checksum_rel:.3g} relative (> 2^-7)")
    del a_MK, b_KN, c_MN
    mem_gib = 0.0
    if device.type == "cuda":
        mem_gib, mem_reasons = memory_fill(device, mem_fraction)
        reasons += mem_reasons
    return ComputeOutcome(str(device), name, str(dtype).replace("torch.", ""), size, tflops, max_rel, checksum_rel,
                          mem_gib, reasons)


def local_devices() -> list[torch.device]:
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]
