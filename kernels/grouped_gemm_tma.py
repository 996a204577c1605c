"""A persistent grouped GEMM that reads its tiles through TMA descriptors: bf16, or e4m3 with row-wise scales.

Same contract as kernels/grouped_gemm.py's row form, with the FP8 scaling of kernels/fp8.py:
  c_NM[r] = a_NK[r] @ b_EKM[e(r)]                                  (bf16 / fp16 operands)
  c_NM[r] = (as_N[r] * aq_NK[r]) @ (bq_EKM[e(r)] * bs_EM[e(r)])    (e4m3 operands, fp32 scales)
for rows r < R = offsets_E1[E]; rows >= R of c are left unwritten. Output bf16 (or a's dtype for 16-bit inputs).

One program per multiprocessor walks the output tiles (expert row tile, column tile): GROUP_M row tiles side by side
per column tile, so that the programs running at once share the A rows they read and B's column tiles in L2. Each
program counts the experts' row tiles from the plan's counts and finds each tile's expert from them, on the device
(no host sync, no torch ops before the launch). The A descriptor spans all N rows: a row tile that runs past its
expert's last row computes rows of the next expert, which the masked store drops. B is read as a 3-d [E, K, M] (or
[E, M, K]) descriptor, so a tile never reads across an expert's end.

FP8 accumulates in fp32: the tensor cores' partial sums are added into the fp32 accumulator every PROMOTE_K
elements of K (DeepSeek-V3's promotion interval, 128), as torch._scaled_grouped_mm does with use_fast_accum=False.
e4m3 tiles must be K-major on both sides (Hopper's 8-bit MMA reads no transposed operand): b_EKM stored as [E, M, K],
which is how kernels/fp8_weights.py lays out every weight operand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2, row_buffer, sm_count, tma_allocator, unit_of

PROMOTE_K = 128


@dataclass(frozen=True)
class Tiles:
    BM: int = 128
    BN: int = 256
    BK: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 1  # row tiles walked side by side before the next column tile (1: columns fastest)
    flatten: bool = False  # one software pipeline over all of a program's tiles (the epilogue overlaps loads)


INTERPRETER_TILES = Tiles(32, 32, 32, 4, 2, group_m=2)  # the CPU: every tile op is interpreted


def default_tiles(scaled: bool) -> Tiles:
    """The tile that ran fastest over the shapes of benchmarks/grouped_gemm_tiles.py (one per operand width)."""
    return Tiles(256, 128, 128, 8, 3, group_m=8) if scaled else Tiles(128, 256, 64, 8, 3, group_m=8, flatten=True)


# Where our kernel beat torch's CUTLASS grouped GEMMs (benchmarks/grouped_gemm_tiles.py and the layer in
# benchmarks/moe_shapes.py, RESULTS.md): 512 to 1024 rows per expert on average (fine-grained experts, or micro-batches
# of 4k-8k tokens at OLMoE's 64 experts), with K and M up to 2048, where CUTLASS's grouped tiles fall short. From 2048
# rows per expert on the two ran at the same rate, and with few large experts CUTLASS's was ahead. With wider dims
# (model dims 3584-7168) ours won some GEMMs alone by up to 1.21x and lost others by 2-4%, yet giving it the winners
# moved the layer by -1.4% to +1.0%, within its noise: those shapes stay on CUTLASS, as does anything unmeasured.
MIN_ROWS_PER_EXPERT, MAX_ROWS_PER_EXPERT = 512, 1024
MAX_DIM = 2048  # of K and M
# torch's sm90 FP8 grouped GEMM runs 128x128x128 tiles only where two of (rows per group, K, M) are at least this;
# elsewhere 128x256x64, which with fp32 promotion runs at about half the rate (benchmarks/fp8_gemms.py). Rows can be
# presented to it (kernels/fp8.py rows_to_present), so a GEMM with K or M this large gets the fast tile; one with both
# below it never does, and our kernel takes it at any rows per expert from MIN_ROWS_PER_EXPERT on (benchmarks/
# RESULTS.md, "The layer at shapes it was never run at").
CUTLASS_FP8_LARGE_DIM = 2048


def choose(N: int, K: int, M: int, E: int, scaled: bool) -> Tiles | None:
    """The tile for an a [N, K] @ b [E, K, M] grouped GEMM (N rows over E experts), or None where torch's CUTLASS
    kernel ran as fast or faster at such shapes, or nobody measured. Pure."""
    rows_per_expert = N // max(E, 1)
    cutlass_slow_tile = scaled and max(K, M) < CUTLASS_FP8_LARGE_DIM  # then no upper bound on the rows
    too_many_rows = rows_per_expert > MAX_ROWS_PER_EXPERT and not cutlass_slow_tile
    if rows_per_expert < MIN_ROWS_PER_EXPERT or too_many_rows or max(K, M) > MAX_DIM:
        return None
    tiles = default_tiles(scaled)
    # one software pipeline over a program's tiles helps where K is short (the epilogue is a larger share)
    return dataclasses.replace(tiles, flatten=True) if scaled and K <= 1024 else tiles


@triton.jit
def dot16(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b for 16-bit tiles. UPCAST: Triton's CPU interpreter multiplies 16-bit tiles wrongly; their products
    are exact in fp32."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def tile_grid(counts_ptr, E, M, BM: tl.constexpr, BN: tl.constexpr, E_PAD: tl.constexpr):
    """-> (tile_ends, n_tiles, total): each expert's row tiles end at tile_ends (the padding experts: never reached),
    n_tiles column tiles, total output tiles. Counted in every program rather than by torch ops before the launch,
    whose host time a small layer call would pay."""
    experts = tl.arange(0, E_PAD)
    tiles_E = tl.cdiv(tl.load(counts_ptr + experts, mask=experts < E, other=0), BM)
    tile_ends = tl.where(experts < E, tl.cumsum(tiles_E, axis=0), 2147483647)
    n_tiles = tl.cdiv(M, BN)
    return tile_ends, n_tiles, tl.sum(tiles_E, axis=0) * n_tiles


@triton.jit
def tile_coords(tile, tile_ends, n_tiles, total, offsets_ptr, BM: tl.constexpr, BN: tl.constexpr,
                GROUP_M: tl.constexpr):
    """-> (e, row0, row_end, n0): output tile `tile` covers rows row0.. (those below row_end are expert e's) and
    columns n0.. ."""
    m_tiles = total // n_tiles
    if GROUP_M == 1:
        pid_m = tile // n_tiles
        pid_n = tile % n_tiles
    else:  # GROUP_M row tiles share each column tile of B while it is in L2 (few large experts)
        width = GROUP_M * n_tiles
        first_m = (tile // width) * GROUP_M
        size = tl.minimum(m_tiles - first_m, GROUP_M)
        pid_m = first_m + (tile % width) % size
        pid_n = (tile % width) // size
    e = tl.sum((tile_ends <= pid_m).to(tl.int32), axis=0)
    first_tile = tl.max(tl.where(tile_ends <= pid_m, tile_ends, 0), axis=0)
    row0 = tl.load(offsets_ptr + e) + (pid_m - first_tile) * BM
    return e, row0, tl.load(offsets_ptr + e + 1), pid_n * BN


@triton.jit
def _gmm_persistent_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,  # a [N, K]; b [E, K, M] as strided; c [N, M]; as [N], bs [E, M] fp32
    offsets_ptr, counts_ptr,  # int32 [E+1] row offsets; int32 [E] rows per expert
    N, E, M, K, s_an, s_be, s_bk, s_bm, s_cn, num_programs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr, B_KMAJOR: tl.constexpr,
    SCALED: tl.constexpr, PROMOTE: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
    UPCAST: tl.constexpr, UNIT: tl.constexpr,
):
    M, s_cn = M * UNIT, s_cn * UNIT  # passed divided by UNIT (_launch.unit_of): c's rows stored in 16-byte vectors
    tile_ends, n_tiles, total = tile_grid(counts_ptr, E, M, BM, BN, E_PAD)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, K], strides=[s_an, 1], block_shape=[BM, BK])
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E, M, K], strides=[s_be, s_bm, 1],
                                           block_shape=[1, BN, BK])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E, K, M], strides=[s_be, s_bk, 1],
                                           block_shape=[1, BK, BN])
    for tile in tl.range(tl.program_id(0), total, num_programs, flatten=FLATTEN):
        e, row0, row_end, n0 = tile_coords(tile, tile_ends, n_tiles, total, offsets_ptr, BM, BN, GROUP_M)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([row0, k0])
            if B_KMAJOR:
                b = b_desc.load([e, n0, k0]).reshape(BN, BK).T
            else:
                b = b_desc.load([e, k0, n0]).reshape(BK, BN)
            if SCALED:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
            else:
                acc = dot16(a, b, acc, UPCAST)
        rows = row0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        row_ok = rows < row_end
        col_ok = cols < M
        if SCALED:
            s_a = tl.load(as_ptr + rows, mask=row_ok, other=0.0)
            s_b = tl.load(bs_ptr + e * M + cols, mask=col_ok, other=0.0)
            acc = acc * s_a[:, None] * s_b[None, :]
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * s_cn + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def programs_for(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, each walking several tiles
    return sm_count(device)


def b_kmajor(b_EKM: torch.Tensor) -> bool:
    return b_EKM.stride(1) == 1


def usable(a_NK: torch.Tensor, b_EKM: torch.Tensor) -> bool:
    """Operands the kernel's descriptors can read: unit stride along a row of a and along K or M of b, every other
    stride and the data 16-byte aligned; e4m3 b K-major. Pure (no device query)."""
    def aligned(t: torch.Tensor, unit_dim: int) -> bool:
        step = 16 // t.element_size()
        return (t.stride(unit_dim) == 1 and t.data_ptr() % 16 == 0
                and all(st % step == 0 for d, st in enumerate(t.stride()) if d != unit_dim))
    if a_NK.stride(1) != 1 or not aligned(a_NK, 1):
        return False
    if b_kmajor(b_EKM):
        return aligned(b_EKM, 1)
    return a_NK.element_size() >= 2 and aligned(b_EKM, 2)


def grouped_mm_persistent(a_NK: torch.Tensor, b_EKM: torch.Tensor, counts_E: torch.Tensor,
                          offsets_E1: torch.Tensor, as_N: torch.Tensor | None = None,
                          bs_EM: torch.Tensor | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """The module docstring's c_NM. as_N / bs_EM: the row and column scales of e4m3 operands (both or neither)."""
    N, K = a_NK.shape
    E, _, M = b_EKM.shape
    scaled = as_N is not None
    if scaled != (bs_EM is not None):
        raise ValueError("as_N and bs_EM go together: both for e4m3 operands, neither for 16-bit ones")
    if not usable(a_NK, b_EKM):
        raise ValueError(f"operands a {tuple(a_NK.stride())} / b {tuple(b_EKM.stride())} ({a_NK.dtype}) cannot be "
                         "read through TMA descriptors: a needs unit-stride rows, b unit stride along K (e4m3) or "
                         "K or M (16-bit), every other stride 16-byte aligned")
    c_NM = row_buffer(N, M, torch.bfloat16 if scaled else a_NK.dtype, a_NK.device)
    if N == 0 or E == 0:
        return c_NM
    t = tiles or (default_tiles(scaled) if a_NK.is_cuda else INTERPRETER_TILES)
    kmajor = b_kmajor(b_EKM)
    upper = (triton.cdiv(N, t.BM) + E) * triton.cdiv(M, t.BN)
    programs = min(programs_for(a_NK.device), upper)
    tma_allocator()
    dummy = c_NM  # scale pointers unused when SCALED is False
    u = unit_of(M, c_NM.stride(0))
    launch(_gmm_persistent_kernel, (programs,), a_NK, b_EKM, c_NM, as_N.contiguous() if scaled else dummy,
           bs_EM.contiguous() if scaled else dummy, offsets_E1, counts_E, N, E, M // u, K, a_NK.stride(0),
           b_EKM.stride(0), b_EKM.stride(1), b_EKM.stride(2), c_NM.stride(0) // u, programs,
           BM=t.BM, BN=t.BN, BK=t.BK, E_PAD=next_pow2(E), B_KMAJOR=kmajor, SCALED=scaled,
           PROMOTE=min(PROMOTE_K, t.BK) if scaled else 0, GROUP_M=t.group_m,
           FLATTEN=t.flatten, UPCAST=not scaled and not a_NK.is_cuda, UNIT=u, num_warps=t.num_warps,
           num_stages=t.num_stages)
    return c_NM
