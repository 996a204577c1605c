"""Compile the FP8 path's Triton kernels, the accumulating weight-gradient GEMM (TMA reads), the persistent TMA
grouped GEMM and the fused SwiGLU GEMMs for sm90 (Hopper) on a machine without a GPU: Triton's own front end and
ptxas, with every constexpr variant the layer launches. Run by test_sm90_compile.py in a fresh interpreter, since a
process that imported moe_launch.kernels without a GPU has Triton in interpreter mode. Prints one line per kernel
variant; exits non-zero on the first failure."""

from __future__ import annotations

import triton  # first, before moe_launch.kernels: compiled mode
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_launch.kernels import fp8, grouped_gemm, grouped_gemm_tma, swiglu, swiglu_gemm

SM90 = GPUTarget("cuda", 90, 32)
SM90_SHARED_BYTES = 232448  # per block, opted in (H100 / H200)
I32, I64, C = "i32", "i64", "constexpr"


def compile_sm90(fn, signature: dict[str, str], constexprs: dict[str, object], **options) -> None:
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=SM90,
                            options=options or None)
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
    # the launch, not the compiler, refuses a kernel that needs more shared memory than a Hopper SM has
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, f"{fn.__name__}: {kernel.metadata.shared} B of shared memory"
    print(f"ok {fn.__name__} {constexprs}")


def main() -> None:
    swiglu_fwd = {"g_ptr": "*bf16", "u_ptr": "*bf16", "h_ptr": "*bf16", "num_rows_ptr": "*i32", "q_ptr": "*fp8e4nv",
                  "s_ptr": "*fp32", "Fdim": I32, "stride_g": I32, "stride_u": I32, "stride_h": I32, "stride_q": I32,
                  "BLOCK_R": C, "BLOCK_F": C, "QUANT": C, "SOFT_ROUND": C}
    swiglu_bwd = {"g_ptr": "*bf16", "u_ptr": "*bf16", "dh_ptr": "*bf16", "dg_ptr": "*bf16", "du_ptr": "*bf16",
                  "h_ptr": "*bf16", "num_rows_ptr": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "w_ptr": "*fp32",
                  "row_pair_ptr": "*i32", "dw_ptr": "*fp32", "Fdim": I32,
                  **{f"stride_{n}": I32 for n in ("g", "u", "dh", "dg", "du", "h", "q")},
                  "BLOCK_R": C, "BLOCK_F": C, "QUANT": C, "ROUTED": C, "SOFT_ROUND": C}
    for quant in (False, True):
        meta = {"BLOCK_R": 4, "BLOCK_F": 1024, "QUANT": quant, "SOFT_ROUND": False}
        compile_sm90(swiglu._swiglu_fwd_kernel, swiglu_fwd, meta)
        for routed in (False, True):
            compile_sm90(swiglu._swiglu_bwd_kernel, swiglu_bwd, {**meta, "ROUTED": routed})
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
             "BM": C, "BN": C, "BR": C, "IEEE": C, "UPCAST": C, "ACCUMULATE": C, "TMA": C}
    t = grouped_gemm.wgrad_tiles(1024, 2048, cuda=True, tma=True)  # what the layer launches into a gradient buffer
    compile_sm90(grouped_gemm._gmm_wgrad_kernel, wgrad, {"BM": t.BM, "BN": t.BN, "BR": t.BR, "IEEE": False,
                                                         "UPCAST": False, "ACCUMULATE": True, "TMA": True},
                 num_warps=t.num_warps, num_stages=t.num_stages)
    persistent_tma(I32, C)


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
             "UPCAST": C}
    for kmajor in (True, False):
        t = grouped_gemm_tma.default_tiles(scaled=False)
        compile_sm90(grouped_gemm_tma._gmm_persistent_kernel, plain,
                     meta(t, kmajor, SCALED=False, PROMOTE=0, UPCAST=False), **opts(t))
    t = grouped_gemm_tma.default_tiles(scaled=True)
    compile_sm90(grouped_gemm_tma._gmm_persistent_kernel, {**plain, "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv"},
                 meta(t, True, SCALED=True, PROMOTE=grouped_gemm_tma.PROMOTE_K, UPCAST=False), **opts(t))
    fused_tail = {**tail, "GROUP_M": C, "FLATTEN": C, "UPCAST": C}
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
