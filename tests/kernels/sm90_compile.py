"""Compile the FP8 path's Triton kernels, the accumulating weight-gradient GEMM (TMA reads), the persistent TMA
grouped GEMM, the fused SwiGLU GEMMs and the row kernels (gather, output reduction, loss) for sm90 (Hopper) on a
machine without a GPU: Triton's own front end and ptxas, with every constexpr variant the layer launches, checking that
rows whose length is a multiple of 8 but not of 16 are still moved in vectors. Run by test_sm90_compile.py in a
fresh interpreter, since a process that imported moe_launch.kernels without a GPU has Triton in interpreter mode.
Prints one line per kernel variant; exits non-zero on the first failure."""

from __future__ import annotations

import re

import triton  # first, before moe_launch.kernels: compiled mode
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_launch.kernels import cross_entropy, fp8, gather, grouped_gemm, grouped_gemm_tma, reduce, swiglu, swiglu_gemm

SM90 = GPUTarget("cuda", 90, 32)
SM90_SHARED_BYTES = 232448  # per block, opted in (H100 / H200)
I32, I64, C = "i32", "i64", "constexpr"


def compile_sm90(fn, signature: dict[str, str], constexprs: dict[str, object], single: int = 0, **options) -> None:
    """Compiled as a launch specializes it with rows of 1,000 bf16 elements: every pointer 16-byte aligned, no integer
    argument a multiple of 16, and UNIT 8 where the kernel takes its row lengths in units (_launch.unit_of gives 8
    for such rows). Such a kernel must then move its 16-bit rows in vectors: a scalar 16-bit global access means the
    rows go one element at a time. single: the scalar accesses the kernel makes on purpose (one element per row)."""
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    units = "UNIT" in signature
    unit = {"UNIT": 8} if units else {}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs={**constexprs, **unit}, attrs=aligned),
                            target=SM90, options=options or None)
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
    # the launch, not the compiler, refuses a kernel that needs more shared memory than a Hopper SM has
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, f"{fn.__name__}: {kernel.metadata.shared} B of shared memory"
    scalar = re.findall(r"(?:ld|st)\.global(?:\.\w+)*\.b16\b", kernel.asm["ptx"])
    assert not units or len(scalar) <= single, (f"{fn.__name__} {constexprs}: {len(scalar)} scalar 16-bit global "
                                                f"accesses ({scalar[0]})")
    print(f"ok {fn.__name__} {constexprs}")


def main() -> None:
    swiglu_fwd = {"g_ptr": "*bf16", "u_ptr": "*bf16", "h_ptr": "*bf16", "num_rows_ptr": "*i32", "q_ptr": "*fp8e4nv",
                  "s_ptr": "*fp32", "Fdim": I32, "stride_g": I32, "stride_u": I32, "stride_h": I32, "stride_q": I32,
                  "BLOCK_R": C, "BLOCK_F": C, "QUANT": C, "SOFT_ROUND": C, "UNIT": C}
    swiglu_bwd = {"g_ptr": "*bf16", "u_ptr": "*bf16", "dh_ptr": "*bf16", "dg_ptr": "*bf16", "du_ptr": "*bf16",
                  "h_ptr": "*bf16", "num_rows_ptr": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "w_ptr": "*fp32",
                  "row_pair_ptr": "*i32", "dw_ptr": "*fp32", "Fdim": I32,
                  **{f"stride_{n}": I32 for n in ("g", "u", "dh", "dg", "du", "h", "q")},
                  "BLOCK_R": C, "BLOCK_F": C, "QUANT": C, "ROUTED": C, "SOFT_ROUND": C, "UNIT": C}
    for quant in (False, True):  # at the tiles the layer launches
        fwd, bwd = (swiglu.row_tile(1024, True, k + " fp8" if quant else k) for k in ("fwd", "bwd"))
        compile_sm90(swiglu._swiglu_fwd_kernel, swiglu_fwd, {"BLOCK_R": fwd.rows, "BLOCK_F": fwd.cols, "QUANT": quant,
                                                             "SOFT_ROUND": False}, num_warps=fwd.warps)
        for routed in (False, True):
            compile_sm90(swiglu._swiglu_bwd_kernel, swiglu_bwd, {"BLOCK_R": bwd.rows, "BLOCK_F": bwd.cols,
                                                                 "QUANT": quant, "SOFT_ROUND": False,
                                                                 "ROUTED": routed}, num_warps=bwd.warps)
    quant_rows = {"x_ptr": "*bf16", "t_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "num_rows_ptr": "*i32",
                  "R": I32, "C": I32, "Ct": I32, **{f"s_{n}": I64 for n in ("xb", "xr", "xc", "tb", "tr", "tc", "qb",
                                                                           "qr", "sb")},
                  "POW2": C, "HAS_NUM_ROWS": C, "SOFT_ROUND": C, "HAS_TAIL": C, "BLOCK_R": C, "BLOCK_C": C,
                  "ONE_PASS": C}
    # rows in one read; rows in two passes with a tail ([dg du]); weight channels (strided tiles), with a tail too
    for tail, one_pass, block_r, block_c in ((False, True, 8, 1024), (True, False, 8, 1024), (False, False, 64, 64),
                                             (True, False, 64, 64)):
        compile_sm90(fp8._quant_rows_kernel, quant_rows, {"POW2": True, "HAS_NUM_ROWS": tail, "SOFT_ROUND": False,
                                                          "HAS_TAIL": tail, "BLOCK_R": block_r, "BLOCK_C": block_c,
                                                          "ONE_PASS": one_pass})
    wgrad = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "offsets_ptr": "*i32", "M": I32, "K": I32,
             **{f"s_{n}": I32 for n in ("an", "am", "bn", "bk", "ce", "cm", "ck")},
             "BM": C, "BN": C, "BR": C, "IEEE": C, "UPCAST": C, "ACCUMULATE": C, "TMA": C, "UNIT": C}
    t = grouped_gemm.wgrad_tiles(1024, 2048, cuda=True, tma=True)  # what the layer launches into a gradient buffer
    # the unit strides are constants, as a launch specializes an integer argument equal to 1
    compile_sm90(grouped_gemm._gmm_wgrad_kernel, {**wgrad, "s_am": C, "s_bk": C, "s_ck": C},
                 {"BM": t.BM, "BN": t.BN, "BR": t.BR, "IEEE": False, "UPCAST": False, "ACCUMULATE": True, "TMA": True,
                  "s_am": 1, "s_bk": 1, "s_ck": 1}, num_warps=t.num_warps, num_stages=t.num_stages)
    persistent_tma(I32, C)
    row_kernels(I32, C)


def row_kernels(I32: str, C: str) -> None:
    """The gather, the output reduction and the loss: row copies and row sums at the model dim and the vocabulary."""
    compile_sm90(gather._gather_kernel, {"x_ptr": "*bf16", "row_token_ptr": "*i32", "out_ptr": "*bf16",
                                         "num_rows_ptr": "*i32", "D": I32, "stride_x": I32, "stride_out": I32,
                                         "BLOCK_R": C, "BLOCK_D": C, "UNIT": C}, {"BLOCK_R": 8, "BLOCK_D": 512})
    combine = {"rows_ptr": "*bf16", "rows2_ptr": "*bf16", "pair_row_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*bf16",
               "T": I32, "K": I32, "D": I32, "stride_rows": I32, "stride_rows2": I32, "stride_out": I32,
               "HAS_W": C, "HAS_ROWS2": C, "BLOCK_T": C, "BLOCK_D": C, "UNIT": C}
    for has_w, has_rows2 in ((True, False), (False, True)):  # the forward; the gathers' backward over dx gate, dx up
        compile_sm90(reduce._combine_fwd_kernel, combine,
                     {"HAS_W": has_w, "HAS_ROWS2": has_rows2, "BLOCK_T": 8, "BLOCK_D": 256})
    xent = {"logits_ptr": "*bf16", "y_ptr": "*i64", "loss_ptr": "*fp32", "V": I32, "stride_row": I32,
            "ignore_index": I32, "WRITE_GRAD": C, "BLOCK_V": C, "UNIT": C}
    # the label's logit is one element of the row
    compile_sm90(cross_entropy._softmax_xent_kernel, xent, {"WRITE_GRAD": True, "BLOCK_V": 4096}, single=1,
                 num_warps=8)


def persistent_tma(I32: str, C: str) -> None:
    """The persistent TMA grouped GEMM with the tiles the layer launches, and the fused SwiGLU GEMMs built on it."""
    walk = {"offsets_ptr": "*i32", "counts_ptr": "*i32", "N": I32, "E": I32, "M": I32, "K": I32, "s_an": I32,
            "s_be": I32, "s_bk": I32, "s_bm": I32}
    tail = {"BM": C, "BN": C, "BK": C, "E_PAD": C, "B_KMAJOR": C}

    def meta(t, kmajor: bool, **more):
        return {"BM": t.BM, "BN": t.BN, "BK": t.BK, "E_PAD": 64, "B_KMAJOR": kmajor, "GROUP_M": t.group_m,
                "FLATTEN": t.flatten, **more}

    def opts(t):
        return {"num_warps": t.num_warps, "num_stages": t.num_stages}

    plain = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32", **walk,
             "s_cn": I32, "num_programs": I32, **tail, "SCALED": C, "PROMOTE": C, "GROUP_M": C, "FLATTEN": C,
             "UPCAST": C, "UNIT": C}
    for kmajor in (True, False):
        t = grouped_gemm_tma.default_tiles(scaled=False)
        compile_sm90(grouped_gemm_tma._gmm_persistent_kernel, plain,
                     meta(t, kmajor, SCALED=False, PROMOTE=0, UPCAST=False), **opts(t))
    t = grouped_gemm_tma.default_tiles(scaled=True)
    compile_sm90(grouped_gemm_tma._gmm_persistent_kernel, {**plain, "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv"},
                 meta(t, True, SCALED=True, PROMOTE=grouped_gemm_tma.PROMOTE_K, UPCAST=False), **opts(t))
    fused_tail = {**tail, "GROUP_M": C, "FLATTEN": C, "UPCAST": C, "UNIT": C}
    tiles = swiglu_gemm.default_tiles()
    up = {**{n: "*bf16" for n in ("a_ptr", "bg_ptr", "bu_ptr", "g_ptr", "u_ptr", "h_ptr")}, **walk, "s_cn": I32,
          "num_programs": I32, **fused_tail}
    dual = {**{n: "*bf16" for n in ("a1_ptr", "a2_ptr", "b1_ptr", "b2_ptr", "c_ptr")}, **walk, "s_cn": I32,
            "num_programs": I32, **fused_tail}
    # as the layer launches them: w_gate/w_up transposed (K-major) forward, as stored (M-major) for dx
    compile_sm90(swiglu_gemm._swiglu_up_kernel, up, meta(tiles.up, True, UPCAST=False), **opts(tiles.up))
    compile_sm90(swiglu_gemm._dual_mm_kernel, dual, meta(tiles.dual, False, UPCAST=False), **opts(tiles.dual))


if __name__ == "__main__":
    main()
