"""The SwiGLU experts' grouped GEMMs with the element-wise stages around them fused in: bf16 (or fp16) operands, fp32
accumulation, on the persistent TMA tile walk of kernels/grouped_gemm_tma.py.

  swiglu_up(x_ND, bg_EDF, bu_EDF)          g = x @ bg, u = x @ bu, h = silu(g) * u   one pass over x's rows, no SwiGLU
                                                                                     kernel reading g and u back
  dual_mm(a1_NK, b1_EKM, a2_NK, b2_EKM)    a1 @ b1 + a2 @ b2, one fp32 accumulator   dx from dg and du without
                                                                                     concatenating the weights, and
                                                                                     one row set to combine
Rows r < R = offsets_E1[E] of an expert-sorted plan; rows >= R are left unwritten. The results equal the unfused
stages (kernels/grouped_gemm.py, kernels/swiglu.py) up to the order of fp32 additions: SwiGLU reads g and u rounded to
the operands' dtype first, as the unfused kernel reads them back from memory; dual_mm rounds once where the unfused
path rounds each product and adds them in the combine.
SwiGLU's backward stays a kernel of its own (kernels/swiglu.py): fused into the dh GEMM's epilogue it ran slower than
the two apart (benchmarks/RESULTS.md), since a persistent tile's epilogue does not overlap its main loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_launch.kernels._launch import launch, next_pow2, row_buffer, tma_allocator, unit_of
from moe_launch.kernels.grouped_gemm import torch_path_ok
from moe_launch.kernels.grouped_gemm_tma import Tiles, b_kmajor, dot16, programs_for, tile_coords, tile_grid, usable


@triton.jit
def _b_tile(b_desc, e, k0, n0, BN: tl.constexpr, BK: tl.constexpr, B_KMAJOR: tl.constexpr):
    if B_KMAJOR:
        return b_desc.load([e, n0, k0]).reshape(BN, BK).T
    return b_desc.load([e, k0, n0]).reshape(BK, BN)


@triton.jit
def _b_desc(b_ptr, E, K, M, s_be, s_bk, s_bm, BN: tl.constexpr, BK: tl.constexpr, B_KMAJOR: tl.constexpr):
    if B_KMAJOR:  # one return: a constexpr branch's return type would be unified with the other's
        desc = tl.make_tensor_descriptor(b_ptr, shape=[E, M, K], strides=[s_be, s_bm, 1], block_shape=[1, BN, BK])
    else:
        desc = tl.make_tensor_descriptor(b_ptr, shape=[E, K, M], strides=[s_be, s_bk, 1], block_shape=[1, BK, BN])
    return desc


@triton.jit
def _swiglu_up_kernel(
    a_ptr, bg_ptr, bu_ptr, g_ptr, u_ptr, h_ptr,  # a [N, K]; bg, bu [E, K, M] with equal strides; g, u, h [N, M]
    offsets_ptr, counts_ptr, N, E, M, K, s_an, s_be, s_bk, s_bm, s_cn, num_programs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr, B_KMAJOR: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, UPCAST: tl.constexpr, UNIT: tl.constexpr,
):
    M, s_cn = M * UNIT, s_cn * UNIT  # passed divided by UNIT (_launch.unit_of): output rows in 16-byte vectors
    tile_ends, n_tiles, total = tile_grid(counts_ptr, E, M, BM, BN, E_PAD)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, K], strides=[s_an, 1], block_shape=[BM, BK])
    bg_desc = _b_desc(bg_ptr, E, K, M, s_be, s_bk, s_bm, BN, BK, B_KMAJOR)
    bu_desc = _b_desc(bu_ptr, E, K, M, s_be, s_bk, s_bm, BN, BK, B_KMAJOR)
    for tile in tl.range(tl.program_id(0), total, num_programs, flatten=FLATTEN):
        e, row0, row_end, n0 = tile_coords(tile, tile_ends, n_tiles, total, offsets_ptr, BM, BN, GROUP_M)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([row0, k0])  # read once for both projections
            acc_g = dot16(a, _b_tile(bg_desc, e, k0, n0, BN, BK, B_KMAJOR), acc_g, UPCAST)
            acc_u = dot16(a, _b_tile(bu_desc, e, k0, n0, BN, BK, B_KMAJOR), acc_u, UPCAST)
        rows = row0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        mask = (rows < row_end)[:, None] & (cols < M)[None, :]
        offs = rows.to(tl.int64)[:, None] * s_cn + cols[None, :]
        g = acc_g.to(g_ptr.dtype.element_ty)
        u = acc_u.to(u_ptr.dtype.element_ty)
        tl.store(g_ptr + offs, g, mask=mask)
        tl.store(u_ptr + offs, u, mask=mask)
        gf = g.to(tl.float32)
        tl.store(h_ptr + offs, (gf * tl.sigmoid(gf) * u.to(tl.float32)).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dual_mm_kernel(
    a1_ptr, a2_ptr, b1_ptr, b2_ptr, c_ptr,  # a1, a2 [N, K] with equal strides; b1, b2 [E, K, M] likewise; c [N, M]
    offsets_ptr, counts_ptr, N, E, M, K, s_an, s_be, s_bk, s_bm, s_cn, num_programs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr, B_KMAJOR: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, UPCAST: tl.constexpr, UNIT: tl.constexpr,
):
    M, s_cn = M * UNIT, s_cn * UNIT  # passed divided by UNIT (_launch.unit_of): output rows in 16-byte vectors
    tile_ends, n_tiles, total = tile_grid(counts_ptr, E, M, BM, BN, E_PAD)
    a1_desc = tl.make_tensor_descriptor(a1_ptr, shape=[N, K], strides=[s_an, 1], block_shape=[BM, BK])
    a2_desc = tl.make_tensor_descriptor(a2_ptr, shape=[N, K], strides=[s_an, 1], block_shape=[BM, BK])
    b1_desc = _b_desc(b1_ptr, E, K, M, s_be, s_bk, s_bm, BN, BK, B_KMAJOR)
    b2_desc = _b_desc(b2_ptr, E, K, M, s_be, s_bk, s_bm, BN, BK, B_KMAJOR)
    for tile in tl.range(tl.program_id(0), total, num_programs, flatten=FLATTEN):
        e, row0, row_end, n0 = tile_coords(tile, tile_ends, n_tiles, total, offsets_ptr, BM, BN, GROUP_M)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            acc = dot16(a1_desc.load([row0, k0]), _b_tile(b1_desc, e, k0, n0, BN, BK, B_KMAJOR), acc, UPCAST)
            acc = dot16(a2_desc.load([row0, k0]), _b_tile(b2_desc, e, k0, n0, BN, BK, B_KMAJOR), acc, UPCAST)
        rows = row0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * s_cn + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows < row_end)[:, None] & (cols < M)[None, :])


@dataclass(frozen=True)
class FusedTiles:
    """One tile per kernel. swiglu_up's BN is each projection's width (its program holds two accumulators)."""
    up: Tiles
    dual: Tiles


INTERPRETER_TILES = FusedTiles(*(Tiles(32, 32, 32, 4, 2, group_m=2) for _ in range(2)))


def default_tiles() -> FusedTiles:
    """The tiles that ran fastest over the shapes of benchmarks/swiglu_gemm_tiles.py. dual_mm reads four tiles per K
    step: with BK 32 three stages fit Hopper's shared memory at a 128 x 256 output tile."""
    return FusedTiles(up=Tiles(128, 128, 64, 8, 4, group_m=8), dual=Tiles(128, 256, 32, 8, 3, group_m=8))


def _tiles(t: Tiles | None, pick: str, device: torch.device) -> Tiles:
    return t or getattr(default_tiles() if device.type == "cuda" else INTERPRETER_TILES, pick)


def fusable(a_NK: torch.Tensor, *bs_EKM: torch.Tensor) -> bool:
    """16-bit operands the descriptors can read, the B operands laid out alike (one set of strides). Pure."""
    return (a_NK.dtype in (torch.bfloat16, torch.float16) and all(b.dtype == a_NK.dtype for b in bs_EKM)
            and all(usable(a_NK, b) and b.stride() == bs_EKM[0].stride() for b in bs_EKM))


# Where the layer ran faster on the fused kernels than on the stages they replace with torch's CUTLASS GEMMs
# (benchmarks/swiglu_gemm_tiles.py and benchmarks/moe_shapes.py, RESULTS.md): 512 rows per expert on average or
# more, with the model dim and the expert hidden size up to 2048. At gpt-oss-20b's 2880 the fused gate+up won but
# dual_mm lost and the layer was 2% slower; with Mixtral's few large experts (4096 x 14336) the fused gate+up only
# equalled CUTLASS and dual_mm was slower. Fewer rows per expert were not measured.
MIN_ROWS_PER_EXPERT = 512
MAX_DIM = 2048


def choose(N: int, D: int, F: int, E: int) -> bool:
    """Whether "auto" fuses the SwiGLU GEMMs of a layer call with N row capacity over E experts. Pure."""
    return N // max(E, 1) >= MIN_ROWS_PER_EXPERT and max(D, F) <= MAX_DIM


def fused_path(impl: str, x_ND: torch.Tensor, w_gate_EFD: torch.Tensor, w_up_EFD: torch.Tensor) -> bool:
    """Whether a bf16 layer call runs the fused kernels: gemm_impl "tma" wherever they can read the operands (sm90+,
    or the CPU under the interpreter); "auto" on Hopper where choose() says they won, and the CUTLASS path could run
    as well (the shape read from the row capacity, as kernels/grouped_gemm.py pick_rows reads it); never else."""
    if impl not in ("tma", "auto"):
        return False
    rows_NF = x_ND.new_empty(0, w_gate_EFD.shape[1])  # how dg and du will be laid out (no storage)
    if not (fusable(x_ND, w_gate_EFD.transpose(1, 2), w_up_EFD.transpose(1, 2))
            and fusable(rows_NF, w_gate_EFD, w_up_EFD)):
        return False
    if not x_ND.is_cuda:
        return impl == "tma"
    cap = torch.cuda.get_device_capability(x_ND.device)
    if impl == "tma":
        return cap[0] >= 9
    E, F, D = w_gate_EFD.shape
    return cap == (9, 0) and torch_path_ok(x_ND, w_gate_EFD, w_up_EFD) and choose(x_ND.shape[0], D, F, E)


def _launch(kernel, a_NK, b_EKM, M: int, counts_E, offsets_E1, t: Tiles, ptrs: tuple, s_cn: int) -> None:
    N, K = a_NK.shape
    E = b_EKM.shape[0]
    programs = min(programs_for(a_NK.device), (triton.cdiv(N, t.BM) + E) * triton.cdiv(M, t.BN))
    tma_allocator()
    u = unit_of(M, s_cn)
    launch(kernel, (programs,), *ptrs, offsets_E1, counts_E, N, E, M // u, K, a_NK.stride(0), b_EKM.stride(0),
           b_EKM.stride(1), b_EKM.stride(2), s_cn // u, programs, BM=t.BM, BN=t.BN, BK=t.BK,
           E_PAD=next_pow2(E), B_KMAJOR=b_kmajor(b_EKM), GROUP_M=t.group_m, FLATTEN=t.flatten,
           UPCAST=not a_NK.is_cuda, UNIT=u, num_warps=t.num_warps, num_stages=t.num_stages)


def _check(a_NK: torch.Tensor, *bs_EKM: torch.Tensor) -> None:
    if not fusable(a_NK, *bs_EKM):
        raise ValueError(f"fused SwiGLU GEMM operands ({a_NK.dtype}, strides a {tuple(a_NK.stride())}, b "
                         f"{[tuple(b.stride()) for b in bs_EKM]}) need 16-bit dtypes, unit-stride 16-byte aligned "
                         "rows and the B operands laid out alike: use kernels/grouped_gemm.py and kernels/swiglu.py")


def swiglu_up(x_ND: torch.Tensor, bg_EDF: torch.Tensor, bu_EDF: torch.Tensor, counts_E: torch.Tensor,
              offsets_E1: torch.Tensor, tiles: Tiles | None = None):
    """-> (g_NF, u_NF, h_NF): the gate and up projections of the rows (b = w_EFD.transpose(1, 2)) and h = silu(g)*u."""
    _check(x_ND, bg_EDF, bu_EDF)
    N, F = x_ND.shape[0], bg_EDF.shape[2]
    g_NF, u_NF, h_NF = (row_buffer(N, F, x_ND.dtype, x_ND.device) for _ in range(3))
    if N and bg_EDF.shape[0]:
        _launch(_swiglu_up_kernel, x_ND, bg_EDF, F, counts_E, offsets_E1, _tiles(tiles, "up", x_ND.device),
                (x_ND, bg_EDF, bu_EDF, g_NF, u_NF, h_NF), g_NF.stride(0))
    return g_NF, u_NF, h_NF


def dual_mm(a1_NK: torch.Tensor, b1_EKM: torch.Tensor, a2_NK: torch.Tensor, b2_EKM: torch.Tensor,
            counts_E: torch.Tensor, offsets_E1: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """c_NM[r] = a1[r] @ b1[e(r)] + a2[r] @ b2[e(r)]: the input gradient dg @ w_gate + du @ w_up."""
    _check(a1_NK, b1_EKM, b2_EKM)
    if a2_NK.shape != a1_NK.shape or a2_NK.stride() != a1_NK.stride() or not usable(a2_NK, b2_EKM):
        raise ValueError("dual_mm's two A operands need one shape and one set of strides")
    N, M = a1_NK.shape[0], b1_EKM.shape[2]
    c_NM = row_buffer(N, M, a1_NK.dtype, a1_NK.device)
    if N and b1_EKM.shape[0]:
        _launch(_dual_mm_kernel, a1_NK, b1_EKM, M, counts_E, offsets_E1, _tiles(tiles, "dual", a1_NK.device),
                (a1_NK, a2_NK, b1_EKM, b2_EKM, c_NM), c_NM.stride(0))
    return c_NM
