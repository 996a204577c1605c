"""Stage 4 of FastSparseMoE: grouped GEMM over all local experts, one launch per matmul (Algorithm 1, lines 74-79).

Shapes: N row capacity (rows of expert e are offsets_E1[e] .. offsets_E1[e+1]-1; rows >= R = offsets_E1[E] are
ignored on input and left unwritten on output), E local experts, K contraction dim, M/Nc output dims.

  grouped_mm(a_NK, b_EKM)        c_NM[r] = a_NK[r] @ b_EKM[e(r)]           (forward, and activation gradients)
  grouped_mm_wgrad(a_NM, b_NK)   c_EMK[e] = a_NM[rows e]^T @ b_NK[rows e]  (weight gradients; 0 for empty experts)
  grouped_mm_wgrad_add_(c, ...)  c_EMK[e] += the same                       (into a gradient buffer)

b_EKM may be any strided view (callers pass w_EFD.transpose(1, 2) for x @ w^T). Paths, chosen per call:
  "torch"     torch.nn.functional.grouped_mm / torch._grouped_mm: CUDA sm90+, bf16 (CUTLASS grouped GEMM)
  "tma"       the row GEMMs on our persistent TMA kernel (kernels/grouped_gemm_tma.py); "auto" takes it per shape
              where it ran faster than CUTLASS (grouped_gemm_tma.choose). Weight gradients: as "auto"
  "triton"    our Triton kernels: any other GPU/dtype, and the CPU under the Triton interpreter
  "reference" a Python loop over experts (host sync; tests only)
No host sync on the torch/triton paths: the Triton row kernel launches cdiv(N, BM) + E row tiles (an upper bound)
and each program finds its expert from per-expert tile counts kept on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_launch.kernels import grouped_gemm_tma as tma
from moe_launch.kernels._launch import launch, next_pow2, tma_allocator, unit_of


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton's CPU interpreter multiplies bf16/fp16 tiles wrongly; fp32 there is exact enough
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _gmm_kernel(
    a_ptr, b_ptr, c_ptr,  # a [N, K]; b [E, K, M] (any strides); c [N, M]
    offsets_ptr, tile_ends_ptr,  # int32 [E+1] row offsets; int32 [E] cumulative BM-row tiles per expert
    E, M, K,
    s_an, s_ak, s_be, s_bk, s_bm, s_cn, s_cm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    experts = tl.arange(0, E_PAD)
    tile_ends = tl.load(tile_ends_ptr + experts, mask=experts < E, other=2147483647)
    e = tl.sum((tile_ends <= pid_m).to(tl.int32), axis=0)  # expert owning this row tile (E: past the last tile)
    live = e < E
    e = tl.minimum(e, E - 1)
    first_tile = tl.max(tl.where(tile_ends <= pid_m, tile_ends, 0), axis=0)
    row_end = tl.where(live, tl.load(offsets_ptr + e + 1), 0)  # dead programs: no valid rows
    rows = tl.load(offsets_ptr + e) + (pid_m - first_tile) * BM + tl.arange(0, BM)
    row_ok = rows < row_end
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < M
    a_base = a_ptr + rows.to(tl.int64)[:, None] * s_an
    b_base = b_ptr + e.to(tl.int64) * s_be + cols[None, :] * s_bm
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_end = tl.where(live, K, 0)  # dead programs skip the loop
    for k0 in range(0, k_end, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(a_base + ks[None, :] * s_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + ks[:, None] * s_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, IEEE, UPCAST)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * s_cn + cols[None, :] * s_cm, acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gmm_wgrad_kernel(
    a_ptr, b_ptr, c_ptr,  # a [N, M]; b [N, K]; c [E, M, K]
    offsets_ptr,
    M, K,
    s_an, s_am, s_bn, s_bk, s_ce, s_cm, s_ck,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ACCUMULATE: tl.constexpr, TMA: tl.constexpr, UNIT: tl.constexpr,
):
    # M, K and the row strides of a, b and c arrive divided by UNIT (_launch.unit_of): rows of c can then be read and
    # written in 16-byte vectors where K is a multiple of 8 but not of 16
    M, K, s_an, s_bn, s_ce, s_cm = M * UNIT, K * UNIT, s_an * UNIT, s_bn * UNIT, s_ce * UNIT, s_cm * UNIT
    # grid (K tiles, M tiles, E): blocks start x-fastest, so one expert's tiles run side by side and its rows are
    # read from L2
    k0 = tl.program_id(0) * BN
    m0 = tl.program_id(1) * BM
    e = tl.program_id(2)
    ms = m0 + tl.arange(0, BM)
    ks = k0 + tl.arange(0, BN)
    m_ok = ms < M
    k_ok = ks < K
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if TMA:  # descriptors that end at the expert's last row: the rows past it load as zeros, no masks
        rows = tl.maximum(end, 1)  # an expert without rows runs no iteration, but a descriptor needs a row
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[rows, M], strides=[s_an, 1], block_shape=[BR, BM])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[rows, K], strides=[s_bn, 1], block_shape=[BR, BN])
        for r0 in range(start, end, BR):
            acc = tl.dot(a_desc.load([r0, m0]).T, b_desc.load([r0, k0]), acc)
    else:
        for r0 in range(start, end, BR):
            rs = (r0 + tl.arange(0, BR)).to(tl.int64)
            r_ok = rs < end
            a = tl.load(a_ptr + rs[None, :] * s_an + ms[:, None] * s_am, mask=m_ok[:, None] & r_ok[None, :],
                        other=0.0)
            b = tl.load(b_ptr + rs[:, None] * s_bn + ks[None, :] * s_bk, mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc = _dot(a, b, acc, IEEE, UPCAST)
    c_tile = c_ptr + e.to(tl.int64) * s_ce + ms[:, None] * s_cm + ks[None, :] * s_ck
    c_ok = m_ok[:, None] & k_ok[None, :]
    if ACCUMULATE:  # c += the product: a gradient buffer takes a micro-batch's share in the GEMM's epilogue
        acc += tl.load(c_tile, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(c_tile, acc.to(c_ptr.dtype.element_ty), mask=c_ok)


def _tile(n: int, cap: int) -> int:
    return max(16, min(cap, next_pow2(n)))  # tl.dot needs every dim >= 16


def grouped_mm_triton(a_NK: torch.Tensor, b_EKM: torch.Tensor, counts_E, offsets_E1) -> torch.Tensor:
    N, K = a_NK.shape
    E, _, M = b_EKM.shape
    c_NM = torch.empty(N, M, dtype=a_NK.dtype, device=a_NK.device)
    if N == 0 or E == 0:
        return c_NM
    cuda = a_NK.is_cuda
    BM, BN, BK = (64, _tile(M, 128), _tile(K, 64)) if cuda else (_tile(N, 1024), _tile(M, 256), _tile(K, 256))
    tile_ends_E = torch.cumsum((counts_E + (BM - 1)) // BM, 0, dtype=torch.int32)
    # On a GPU the grid is an upper bound (reading the exact tile count would be a host sync); on the CPU the count
    # is already on the host and the interpreter pays for every program, dead ones included.
    m_tiles = triton.cdiv(N, BM) + E if cuda else int(tile_ends_E[-1])
    grid = (m_tiles, triton.cdiv(M, BN))
    launch(_gmm_kernel, grid, a_NK, b_EKM, c_NM, offsets_E1, tile_ends_E, E, M, K,
           a_NK.stride(0), a_NK.stride(1), *b_EKM.stride(), c_NM.stride(0), c_NM.stride(1),
           BM=BM, BN=BN, BK=BK, E_PAD=next_pow2(E), IEEE=a_NK.dtype == torch.float32, UPCAST=not cuda)
    return c_NM


@dataclass(frozen=True)
class WgradTiles:
    BM: int
    BN: int
    BR: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False


def wgrad_tiles(M: int, K: int, cuda: bool, tma: bool) -> WgradTiles:
    """Tile of the weight-gradient kernel. With TMA the one that ran fastest at the OLMoE shapes and close to it at
    coarse and fine ones (benchmarks/wgrad_accumulate.py); on the CPU (interpreter) one program per expert where the
    sizes allow."""
    if not cuda:
        return WgradTiles(_tile(M, 256), _tile(K, 256), 1024)
    if tma:
        return WgradTiles(128, 256, 64, num_warps=8, num_stages=3, tma=True)
    return WgradTiles(_tile(M, 64), _tile(K, 64), 64)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Rows our kernel can read through TMA descriptors: sm90+, 16-bit, unit last stride, 16-byte aligned."""
    t0 = tensors[0]
    if not t0.is_cuda or torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    return all(t.dtype in (torch.bfloat16, torch.float16) and t.stride(-1) == 1 and aligned_16(t) for t in tensors)


def grouped_mm_wgrad_triton(a_NM: torch.Tensor, b_NK: torch.Tensor, offsets_E1: torch.Tensor,
                            out_EMK: torch.Tensor | None = None, tiles: WgradTiles | None = None) -> torch.Tensor:
    """out_EMK given: the products are added to it in place (its dtype; accumulated in fp32 inside the kernel)."""
    M, K = a_NM.shape[1], b_NK.shape[1]
    E = offsets_E1.numel() - 1
    c_EMK = out_EMK if out_EMK is not None else torch.empty(E, M, K, dtype=a_NM.dtype, device=a_NM.device)
    if E == 0:
        return c_EMK
    cuda = a_NM.is_cuda
    t = tiles or wgrad_tiles(M, K, cuda, tma_ok(a_NM, b_NK))
    if t.tma:
        tma_allocator()
    grid = (triton.cdiv(K, t.BN), triton.cdiv(M, t.BM), E)
    s_ce, s_cm, s_ck = c_EMK.stride()
    u = unit_of(M, K, a_NM.stride(0), b_NK.stride(0), s_ce, s_cm)
    launch(_gmm_wgrad_kernel, grid, a_NM, b_NK, c_EMK, offsets_E1, M // u, K // u, a_NM.stride(0) // u,
           a_NM.stride(1), b_NK.stride(0) // u, b_NK.stride(1), s_ce // u, s_cm // u, s_ck, BM=t.BM, BN=t.BN,
           BR=t.BR, IEEE=a_NM.dtype == torch.float32, UPCAST=not cuda, ACCUMULATE=out_EMK is not None, TMA=t.tma,
           UNIT=u, num_warps=t.num_warps, num_stages=t.num_stages)
    return c_EMK


def _torch_grouped_mm():
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def aligned_16(t: torch.Tensor) -> bool:
    """CUTLASS's layout rule for a GEMM operand: the data 16-byte aligned and every stride but the unit one a
    multiple of 16 bytes (a model dim or expert hidden size that is not a multiple of 8 in bf16 breaks it). Pure."""
    step = 16 // t.element_size()
    strides = [st for st, n in zip(t.stride(), t.shape) if n > 1 and st != 1]
    return t.data_ptr() % 16 == 0 and all(st % step == 0 for st in strides)


def torch_path_ok(*tensors: torch.Tensor) -> bool:
    """CUTLASS grouped GEMM: sm90+, bf16, 16-byte aligned operands (else our Triton kernel takes the GEMM)."""
    t0 = tensors[0]
    if _torch_grouped_mm() is None or not t0.is_cuda or torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    return all(t.dtype == torch.bfloat16 and aligned_16(t) for t in tensors)


def grouped_mm_torch(a_NK, b_EKM, ends_E):
    return _torch_grouped_mm()(a_NK, b_EKM, offs=ends_E)


def grouped_mm_wgrad_torch(a_NM, b_NK, ends_E):
    return _torch_grouped_mm()(a_NM.t(), b_NK, offs=ends_E)


def grouped_mm_reference(a_NK, b_EKM, counts_E, offsets_E1):
    c_NM = torch.zeros(a_NK.shape[0], b_EKM.shape[2], dtype=a_NK.dtype, device=a_NK.device)
    for e, (lo, hi) in enumerate(zip(offsets_E1[:-1].tolist(), offsets_E1[1:].tolist())):  # host sync
        c_NM[lo:hi] = a_NK[lo:hi] @ b_EKM[e]
    return c_NM


def grouped_mm_wgrad_reference(a_NM, b_NK, offsets_E1):
    E = offsets_E1.numel() - 1
    c_EMK = torch.zeros(E, a_NM.shape[1], b_NK.shape[1], dtype=a_NM.dtype, device=a_NM.device)
    for e, (lo, hi) in enumerate(zip(offsets_E1[:-1].tolist(), offsets_E1[1:].tolist())):
        c_EMK[e] = a_NM[lo:hi].t() @ b_NK[lo:hi]
    return c_EMK


IMPLS = ("auto", "torch", "tma", "triton", "reference")


def pick(impl: str, *tensors: torch.Tensor) -> str:
    """The path of a weight-gradient GEMM ("tma" has none of its own: it takes auto's)."""
    if impl not in IMPLS:
        raise ValueError(f"grouped GEMM impl {impl!r} is not one of {IMPLS}")
    if impl in ("auto", "tma"):
        return "torch" if torch_path_ok(*tensors) else "triton"
    return impl


def pick_rows(impl: str, a_NK: torch.Tensor, b_EKM: torch.Tensor) -> tuple[str, tma.Tiles | None]:
    """The path of a row GEMM, and for "tma" its tile (None: the kernel's default). "auto" takes our persistent TMA
    kernel where the CUTLASS path could run and our kernel ran faster at the shape (grouped_gemm_tma.choose); "tma"
    wherever its descriptors can read the operands (sm90+, or the CPU under the interpreter), else what "auto"
    would take. The shape is read from the operands: their row capacity, not the routed rows (reading those would
    sync with the device). Under expert parallelism with the allgather dispatcher the capacity counts every rank's
    pairs, so the rows per local expert are overestimated and the choice leans towards CUTLASS."""
    N, K = a_NK.shape
    E, M = b_EKM.shape[0], b_EKM.shape[2]
    if impl == "tma" and tma.usable(a_NK, b_EKM) and (
            not a_NK.is_cuda or torch.cuda.get_device_capability(a_NK.device)[0] >= 9):
        return "tma", tma.choose(N, K, M, E, scaled=False)  # None: the kernel's default for the device
    if impl == "auto" and torch_path_ok(a_NK, b_EKM) and tma.usable(a_NK, b_EKM) and (
            torch.cuda.get_device_capability(a_NK.device) == (9, 0)):  # where the choice was measured (Hopper)
        tiles = tma.choose(N, K, M, E, scaled=False)
        if tiles is not None:
            return "tma", tiles
    return pick(impl, a_NK, b_EKM), None


def grouped_mm(a_NK, b_EKM, plan, impl: str = "auto") -> torch.Tensor:
    """c_NM[r] = a_NK[r] @ b_EKM[e(r)] for rows r < R of a RoutePlan (or anything with counts_E/ends_E/offsets_E1)."""
    impl, tiles = pick_rows(impl, a_NK, b_EKM)
    if impl == "tma":
        return tma.grouped_mm_persistent(a_NK, b_EKM, plan.counts_E, plan.offsets_E1, tiles=tiles)
    if impl == "torch":
        return grouped_mm_torch(a_NK, b_EKM, plan.ends_E)
    if impl == "triton":
        return grouped_mm_triton(a_NK, b_EKM, plan.counts_E, plan.offsets_E1)
    return grouped_mm_reference(a_NK, b_EKM, plan.counts_E, plan.offsets_E1)


def grouped_mm_wgrad(a_NM, b_NK, plan, impl: str = "auto") -> torch.Tensor:
    """c_EMK[e] = a_NM[rows of e]^T @ b_NK[rows of e]; zeros for experts with no rows."""
    impl = pick(impl, a_NM, b_NK)
    if impl == "torch":
        return grouped_mm_wgrad_torch(a_NM, b_NK, plan.ends_E)
    if impl == "triton":
        return grouped_mm_wgrad_triton(a_NM, b_NK, plan.offsets_E1)
    return grouped_mm_wgrad_reference(a_NM, b_NK, plan.offsets_E1)


def grouped_mm_wgrad_add_(out_EMK: torch.Tensor, a_NM, b_NK, plan, impl: str = "auto") -> None:
    """out_EMK += grouped_mm_wgrad(a_NM, b_NK, plan): how a gradient buffer takes one micro-batch's expert weight
    gradients. Where the torch path would run and our kernel can read the rows through TMA, our kernel adds the old
    values in its epilogue: about 10% faster than torch's GEMM followed by an add at the OLMoE shapes, though its
    GEMM alone is slower (benchmarks/wgrad_accumulate.py). Elsewhere: the product, then an add."""
    impl = pick(impl, a_NM, b_NK)
    if impl == "triton" or (impl == "torch" and tma_ok(a_NM, b_NK)):
        grouped_mm_wgrad_triton(a_NM, b_NK, plan.offsets_E1, out_EMK=out_EMK)
    else:
        out_EMK += grouped_mm_wgrad(a_NM, b_NK, plan, impl)
