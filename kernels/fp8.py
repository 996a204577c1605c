"""FP8 (e4m3) for the expert GEMMs: fine-grained row-wise quantization and the scaled grouped GEMM.

Scaling follows DeepSeek-V3's fine-grained recipe at the granularity torch's rowwise scaled grouped GEMM takes:
  activations a_NK   one scale per row (token row): amax over K
  expert weights     one scale per output channel: the b operand b_EKM gets s_EM, amax over K for each (e, m)
  x ~= q * s, q in e4m3 (|q| <= 448), s = max(amax, AMAX_EPS) * fp32(1/448) (fp32 scales) or that rounded UP to a
  power of two (pow2 scales, the default: dividing by a power of two is exact and the largest |q| lands in
  [224, 448]). q is the round-to-nearest-even e4m3 neighbour of x * (1/s) (IEEE fp32 ops, the same on the GPU, in
  the interpreter and in torch), clamped to +-448 (saturating, never inf/NaN). An all-zero row gets the tiny scale
  AMAX_EPS / 448 and all-zero codes.

Shapes: N row capacity, R valid rows (device scalar), K contraction dim, M output dim, E local experts.

  quantize_rows(x_[B]RC, num_rows=None) -> (q_[B]RC e4m3 contiguous, s_[B]R fp32)   x any strides
  quantize_rows(x, tail=t_[B]RC')      -> the rows of cat([x, t], -1), never concatenated
  quantize_operand(b_EKM)              -> (q_EKM column-major e4m3, s_EM)            the b operand of a GEMM
  scaled_grouped_mm(aq_NK, as_N, bq_EKM, bs_EM, plan) -> c_NM bf16 = (as*aq)[r] @ (bq*bs)[e(r)]
Paths: "torch" is torch._scaled_grouped_mm (CUTLASS, sm90, fp32 accumulation, bf16 out); "reference" dequantizes
to fp32 and loops over experts (host sync; tests and CPU). The quantization runs as one Triton kernel (CPU: the
interpreter) beside its plain-torch reference. Quantizing the weights by output channel needs the channel's values
along K: for x @ w^T that is a row of w as stored, for the activation gradient (dy @ w) a column, which the kernel
reads with strided tiles. The expert weights' operands are built (and reused within a step) by kernels/fp8_weights.py:
the master weights and the optimizer never see FP8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_launch.kernels import grouped_gemm_tma as tma
from moe_launch.kernels._launch import launch, next_pow2

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_EPS = 1e-12  # floor of a row's amax: zero rows get a finite scale and zero codes, never 0/0


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) -> the nearest e4m3 value, ties to even, as fp32, so that the cast after it is exact.
    Only for Triton's CPU interpreter, whose fp32 -> e4m3 cast rounds wrongly across a binade; on the GPU the cast
    instruction itself rounds to nearest even (cvt.rn.satfinite)."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # binade of |v| (-127 for 0)
    e = tl.maximum(e, -6)  # below 2^-6 e4m3 is subnormal: a fixed step of 2^-9
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: step = 2^(e-3)
    y = a * ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # a / step, exact (a power of two)
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)  # a tie goes to even
    negative = v.to(tl.int32, bitcast=True) < 0  # the sign bit, so that -0.0 stays -0.0 as in the cast
    # a product keeps the sign of a zero; Triton 3.6's interpreter negates as 0 - x, which gives +0.0
    return tl.where(negative, -1.0, 1.0) * (r * step)


@triton.jit
def _scales(amax, POW2: tl.constexpr):
    """-> (s, 1/s) of rows with this amax. 1/s by IEEE division (div_rn: the plain `/` approximates on the GPU)."""
    s = tl.maximum(amax, 1e-12) * 0.002232142857142857  # AMAX_EPS, 1 / E4M3_MAX (rounded to fp32, as in torch)
    if POW2:  # round the scale up to a power of two: add all-ones to the mantissa, keep the exponent
        s = ((s.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return s, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def _encode(x, inv_s, q_ty, SOFT_ROUND: tl.constexpr):
    v = tl.minimum(tl.maximum(x * inv_s[:, None], -448.0), 448.0)
    if SOFT_ROUND:
        v = _round_e4m3(v)
    return v.to(q_ty)


@triton.jit
def _amax_of(x_rows, s_xc, C, row_ok, amax, BLOCK_C: tl.constexpr):
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = row_ok[:, None] & (cols < C)[None, :]
        x = tl.load(x_rows + cols[None, :] * s_xc, mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    return amax


@triton.jit
def _encode_into(x_rows, s_xc, C, q_rows, row_ok, inv_s, SOFT_ROUND: tl.constexpr, BLOCK_C: tl.constexpr):
    for c0 in range(0, C, BLOCK_C):  # the re-read after the amax pass comes from cache
        cols = c0 + tl.arange(0, BLOCK_C)
        m = row_ok[:, None] & (cols < C)[None, :]
        x = tl.load(x_rows + cols[None, :] * s_xc, mask=m, other=0.0).to(tl.float32)
        tl.store(q_rows + cols[None, :], _encode(x, inv_s, q_rows.dtype.element_ty, SOFT_ROUND), mask=m)


@triton.jit
def _quant_rows_kernel(
    x_ptr, t_ptr, q_ptr, s_ptr,  # x [B, R, C], tail t [B, R, Ct] (HAS_TAIL) any strides; q [B, R, C + Ct] e4m3 and
    num_rows_ptr,  # s [B, R] fp32, unit last strides; int32 [] rows per batch to quantize (HAS_NUM_ROWS): rows
    R, C, Ct, s_xb, s_xr, s_xc, s_tb, s_tr, s_tc, s_qb, s_qr, s_sb,  # beyond it are left unwritten
    POW2: tl.constexpr, HAS_NUM_ROWS: tl.constexpr, SOFT_ROUND: tl.constexpr, HAS_TAIL: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ONE_PASS: tl.constexpr,  # ONE_PASS: no tail, C <= BLOCK_C
):
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    if HAS_NUM_ROWS:
        row_ok = row_ok & (rows < tl.load(num_rows_ptr))
    x_rows = x_ptr + b * s_xb + rows.to(tl.int64)[:, None] * s_xr
    q_rows = q_ptr + b * s_qb + rows.to(tl.int64)[:, None] * s_qr
    if ONE_PASS:  # the whole row in registers: one read
        cols = tl.arange(0, BLOCK_C)
        m = row_ok[:, None] & (cols < C)[None, :]
        x = tl.load(x_rows + cols[None, :] * s_xc, mask=m, other=0.0).to(tl.float32)
        s, inv_s = _scales(tl.max(tl.abs(x), axis=1), POW2)
        tl.store(q_rows + cols[None, :], _encode(x, inv_s, q_ptr.dtype.element_ty, SOFT_ROUND), mask=m)
    else:  # pass 1: each row's amax (over x, then the tail), pass 2: quantize
        t_rows = t_ptr + b * s_tb + rows.to(tl.int64)[:, None] * s_tr
        amax = _amax_of(x_rows, s_xc, C, row_ok, tl.zeros([BLOCK_R], dtype=tl.float32), BLOCK_C)
        if HAS_TAIL:
            amax = _amax_of(t_rows, s_tc, Ct, row_ok, amax, BLOCK_C)
        s, inv_s = _scales(amax, POW2)
        _encode_into(x_rows, s_xc, C, q_rows, row_ok, inv_s, SOFT_ROUND, BLOCK_C)
        if HAS_TAIL:
            _encode_into(t_rows, s_tc, Ct, q_rows + C, row_ok, inv_s, SOFT_ROUND, BLOCK_C)
    tl.store(s_ptr + b * s_sb + rows, s, mask=row_ok)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 3 else x.unsqueeze(0)


def _outputs(shape: tuple[int, ...], device: torch.device,
             out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) to write: fresh contiguous ones, or the caller's views (a part of a larger operand), checked."""
    if out is None:
        return (torch.empty(shape, dtype=E4M3, device=device),
                torch.empty(shape[:-1], dtype=torch.float32, device=device))
    q, s = out
    if tuple(q.shape) != shape or tuple(s.shape) != shape[:-1] or q.dtype != E4M3 or s.dtype != torch.float32:
        raise ValueError(f"out=(q {tuple(q.shape)} {q.dtype}, s {tuple(s.shape)} {s.dtype}) does not fit the rows "
                         f"{shape}: q must be e4m3 of that shape, s fp32 of it without the last dim")
    if q.stride(-1) != 1 or s.stride(-1) != 1:
        raise ValueError("out: q and s need a unit stride along their last dim")
    return q, s


def _row_shape(x: torch.Tensor, tail: torch.Tensor | None) -> tuple[int, ...]:
    if tail is None:
        return tuple(x.shape)
    if tail.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"tail {tuple(tail.shape)} must match x {tuple(x.shape)} in every dim but the last")
    return (*x.shape[:-1], x.shape[-1] + tail.shape[-1])


def quantize_rows_triton(x: torch.Tensor, num_rows: torch.Tensor | None = None, pow2: bool = True,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None,
                         tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    x3 = _as_3d(x)
    B, R, C = x3.shape
    q_out, s_out = _outputs(_row_shape(x, tail), x.device, out)
    q, s = _as_3d(q_out), s_out if s_out.dim() == 2 else s_out.unsqueeze(0)
    t3 = _as_3d(tail) if tail is not None else x3  # unused when HAS_TAIL is False
    Ct = t3.shape[2] if tail is not None else 0
    if q.numel() > 0:
        cuda = x.is_cuda
        if (x3.stride(2) == 1 and t3.stride(2) == 1) or not cuda:  # rows contiguous: whole rows per program
            BLOCK_C = min(next_pow2(max(C, Ct)), 4096)
            BLOCK_R = max(1, (8192 if cuda else 65536) // BLOCK_C)
        else:  # channels of a weight read across its rows: tiles whose memory-contiguous axis is the row axis
            BLOCK_R, BLOCK_C = 64, min(next_pow2(max(C, Ct)), 64)
        nr = num_rows if num_rows is not None else s  # unused when HAS_NUM_ROWS is False
        launch(_quant_rows_kernel, (triton.cdiv(R, BLOCK_R), B), x3, t3, q, s, nr, R, C, Ct, *x3.stride(),
               *t3.stride(), q.stride(0), q.stride(1), s.stride(0), POW2=pow2, HAS_NUM_ROWS=num_rows is not None,
               SOFT_ROUND=not cuda, HAS_TAIL=tail is not None, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
               ONE_PASS=tail is None and C <= BLOCK_C, num_warps=8 if cuda and BLOCK_R * BLOCK_C >= 8192 else 4)
    return q_out, s_out


def row_scales_reference(x: torch.Tensor, pow2: bool = True) -> torch.Tensor:
    s = x.float().abs().amax(-1).clamp_min(AMAX_EPS) * (1 / E4M3_MAX)
    return torch.exp2(torch.ceil(torch.log2(s))) if pow2 else s


def quantize_rows_reference(x: torch.Tensor, num_rows: torch.Tensor | None = None, pow2: bool = True,
                            out: tuple[torch.Tensor, torch.Tensor] | None = None,
                            tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract; every row is quantized (rows >= num_rows may hold anything)."""
    shape = _row_shape(x, tail)
    if tail is not None:
        x = torch.cat([x, tail], dim=-1)
    s = row_scales_reference(x, pow2)
    q = (x.float() * s.reciprocal()[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # the cast: nearest, ties even
    if out is None:
        return q.contiguous(), s
    q_out, s_out = _outputs(shape, x.device, out)
    q_out.copy_(q)
    s_out.copy_(s)
    return q_out, s_out


def quantize_rows(x: torch.Tensor, num_rows: torch.Tensor | None = None, pow2: bool = True, impl: str = "triton",
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantization of a [R, C] or [B, R, C] tensor (any strides) -> (q, s fp32): q contiguous, or
    written into out=(q, s), views with a unit last-dim stride (say, one half of a larger operand). `tail`: a second
    tensor continuing x's rows ([.., R, Ct], any strides): the rows of cat([x, tail], -1) are quantized, one scale
    each, without the concatenation being made."""
    fn = quantize_rows_triton if impl == "triton" else quantize_rows_reference
    return fn(x, num_rows, pow2, out, tail)


def dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s[..., None]


def quantize_operand(b_EKM: torch.Tensor, impl: str = "triton",
                     tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The b operand of a grouped GEMM (any strided view of an expert weight) -> (q_EKM, s_EM): one scale per output
    channel m, q column-major as torch._scaled_grouped_mm requires. `tail` [E, K', M]: a second weight continuing
    b along K (the operand of cat([b, tail], 1), one scale per channel over both, never concatenated)."""
    q_EMK, s_EM = quantize_rows(b_EKM.transpose(1, 2), impl=impl,
                                tail=None if tail is None else tail.transpose(1, 2))
    return q_EMK.transpose(1, 2), s_EM


def fp8_gemm_supported(device: torch.device | str) -> bool:
    """torch._scaled_grouped_mm with row-wise fp32 scales: CUTLASS kernels for sm90 (Hopper) only."""
    device = torch.device(device)
    if device.type != "cuda" or getattr(torch, "_scaled_grouped_mm", None) is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) == (9, 0)


# torch's sm90 FP8 grouped GEMM picks its CUTLASS tile from the mean rows per group m = rows / groups and the GEMM's
# K and N (grouped_gemm_tma.CUTLASS_FP8_LARGE_DIM says how). Handing it more rows (never read: the groups end at
# offs[-1]) makes a GEMM with K or N >= 2048 "large" (benchmarks/fp8_gemms.py measures both).
# The presented rows cost memory while the GEMM runs (a with that many rows and torch's output; no compute): at most
# MAX_PRESENTED_FACTOR times the real ones, which covers 512 rows per group and more. Producers that know the count
# (kernels/moe.py _Fp8Gemms.presented) write a into a buffer that long, so that a is not copied to present it.
MAX_PRESENTED_FACTOR = 4


def rows_to_present(rows: int, groups: int, K: int, M: int) -> int:
    """How many rows to hand torch._scaled_grouped_mm for an a [rows, K] @ b [groups, K, M] GEMM so that it runs its
    128x128x128 tiles: `rows` itself where those are chosen anyway or cannot be (the small-shape tiles, or K and M
    both below `big` = tma.CUTLASS_FP8_LARGE_DIM) or would take more than MAX_PRESENTED_FACTOR x the rows, else `big`
    rows per group. Pure."""
    big = tma.CUTLASS_FP8_LARGE_DIM
    m = rows // max(groups, 1)
    small = m <= 128 or M <= 128
    large = sum(v >= big for v in (m, K, M)) >= 2
    wanted = big * groups
    if small or large or max(K, M) < big or wanted > MAX_PRESENTED_FACTOR * rows:
        return rows
    return wanted


def _with_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with `rows` rows along dim 0: x's own rows first, the rest unspecified (no kernel reads them). A view where
    x has that many rows or more (a producer allocated them), a copy where it has fewer."""
    if x.shape[0] >= rows:
        return x if x.shape[0] == rows else x[:rows]
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    out[:x.shape[0]].copy_(x)
    return out


def scaled_grouped_mm_torch(aq_NK, as_N, bq_EKM, bs_EM, ends_E, compact: bool = True,
                            n_rows: int | None = None) -> torch.Tensor:
    """`compact`: an output computed over presented rows is copied back to N rows (False: an [N, M] view of the
    larger buffer, for outputs used once and freed, where the copy would cost more than the memory). n_rows: N, where
    aq_NK and as_N hold more rows than that (already presented; default: all of aq_NK's)."""
    N, K = (n_rows if n_rows is not None else aq_NK.shape[0]), aq_NK.shape[1]
    rows = rows_to_present(N, bq_EKM.shape[0], K, bq_EKM.shape[2])
    # use_fast_accum=False: CUTLASS promotes the tensor cores' partial sums into fp32 accumulators
    c = torch._scaled_grouped_mm(_with_rows(aq_NK, rows), bq_EKM, _with_rows(as_N, rows), bs_EM, offs=ends_E,
                                 out_dtype=torch.bfloat16, use_fast_accum=False)
    if rows == N:
        return c
    return c[:N].clone() if compact else c[:N]


def scaled_grouped_mm_reference(aq_NK, as_N, bq_EKM, bs_EM, offsets_E1) -> torch.Tensor:
    """Dequantize to fp32, multiply per expert in fp32, round once to bf16. Rows >= R are zero."""
    a = dequantize_rows(aq_NK, as_N)
    b = bq_EKM.float() * bs_EM[:, None, :]
    c_NM = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float32, device=a.device)
    for e, (lo, hi) in enumerate(zip(offsets_E1[:-1].tolist(), offsets_E1[1:].tolist())):  # host sync
        c_NM[lo:hi] = a[lo:hi] @ b[e]
    return c_NM.to(torch.bfloat16)


def scaled_grouped_mm(aq_NK, as_N, bq_EKM, bs_EM, plan, impl: str = "torch", compact: bool = True) -> torch.Tensor:
    """c_NM[r] = (as_N[r] * aq_NK[r]) @ (bq_EKM[e(r)] * bs_EM[e(r)]) for rows r < R of a RoutePlan, in bf16, N rows.
    impl: "torch" | "tma" (our persistent kernel; both sm90: anything else is refused here rather than silently slow)
    | "reference". compact=False lets the result be a view of a larger buffer (see scaled_grouped_mm_torch). aq_NK
    and as_N may hold more than the plan's N rows (a producer's presented rows)."""
    N = plan.row_token_N.numel()
    if impl == "reference":
        return scaled_grouped_mm_reference(aq_NK[:N], as_N[:N], bq_EKM, bs_EM, plan.offsets_E1)
    if impl not in ("torch", "tma"):
        raise ValueError(f"FP8 grouped GEMM impl {impl!r} is not one of ('torch', 'tma', 'reference')")
    if not fp8_gemm_supported(aq_NK.device):
        raise RuntimeError(f"the FP8 grouped GEMM needs an sm90 GPU; got {aq_NK.device} "
                           "(use precision='bf16', or gemm_impl='reference' for the slow fp32 emulation)")
    if impl == "tma":
        E, K, M = bq_EKM.shape
        tiles = tma.choose(N, K, M, E, scaled=True)  # None (a shape auto leaves to CUTLASS): the default tile
        return tma.grouped_mm_persistent(aq_NK[:N], bq_EKM, plan.counts_E, plan.offsets_E1, as_N[:N], bs_EM,
                                         tiles=tiles)
    return scaled_grouped_mm_torch(aq_NK, as_N, bq_EKM, bs_EM, plan.ends_E, compact, n_rows=N)
