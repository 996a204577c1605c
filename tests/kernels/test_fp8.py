"""FP8 expert path: e4m3 row scaling, the Triton quantization kernel against its torch reference (Triton's
interpreter on the CPU), the scaled grouped GEMM's fp32 emulation, the fp8 layer against the bf16 reference, and the
model.moe.precision checks. The fast GEMM (torch._scaled_grouped_mm, sm90) is checked by benchmarks/moe_layer.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers_gpu import host_gpu_capability
from kernel_helpers import input_generator, random_idx, rel_err, run_compiled

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.errors import ConfigError
from moe_launch.kernels import fp8, gather, swiglu
from moe_launch.kernels.grouped_gemm import grouped_mm_reference
from moe_launch.kernels.index_gen import route_indices
from moe_launch.kernels.moe import _Fp8Gemms, fast_experts
from moe_launch.trainer.moe import layer as layer_mod
from moe_launch.trainer.moe.reference import experts_reference


def _wide_rows(R: int, C: int, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """Rows spanning 1e-8 .. 1e3 in magnitude, one all-zero row, one with a single non-zero."""
    x = torch.randn(R, C, generator=gen) * torch.logspace(-8, 3, R)[torch.randperm(R, generator=gen)][:, None]
    x[R // 3] = 0
    x[R // 2] = 0
    x[R // 2, C // 2] = -3.0
    return x.to(dtype)


def _all_e4m3_and_ties() -> torch.Tensor:
    """Every finite e4m3 value, each midpoint between neighbours (a tie), and points just either side of it."""
    v = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).float()
    v = v[v.isfinite()].unique()
    mid = (v[1:] + v[:-1]) / 2
    eps = mid.abs() * 1e-3 + 1e-6
    return torch.cat([v, mid, mid + eps, mid - eps])


@pytest.mark.parametrize("pow2", [True, False])
def test_scales_from_amax(pow2):
    x = _wide_rows(40, 77, input_generator(), torch.float32)
    s = fp8.row_scales_reference(x, pow2)
    amax = x.abs().amax(1).clamp_min(fp8.AMAX_EPS)
    if pow2:
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
        assert bool((s >= amax / 448 * (1 - 1e-6)).all() and (s < 2 * amax / 448).all())  # the smallest that fits
    else:
        assert torch.equal(s, amax * (1 / 448))  # times fp32(1/448): one IEEE product on every device
    q, s2 = fp8.quantize_rows_reference(x, pow2=pow2)
    assert torch.equal(s, s2)
    peak = q.float().abs().amax(1)[amax > fp8.AMAX_EPS]
    assert bool((peak <= 448).all() and (peak >= (224 if pow2 else 448)).all())  # the range is used, never exceeded


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the -inf row: inf * 0 is NaN
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_zero_rows_and_saturation(impl, pow2):
    x = torch.zeros(4, 64)
    x[1] = 3e37  # huge but finite: finite scale, codes at the top of the range, no inf/NaN
    x[1, 5] = -3.0001e37  # the amax, slightly above the rest
    x[2, :3] = torch.tensor([-1e-30, 0.0, 2e-30])  # below the amax floor
    x[3, 0] = float("-inf")
    q, s = fp8.quantize_rows(x, pow2=pow2, impl=impl)
    assert bool((q[0].float() == 0).all()) and s[0] == fp8.row_scales_reference(torch.zeros(1, 1), pow2)[0]
    assert bool((fp8.dequantize_rows(q, s)[0] == 0).all())
    assert torch.isfinite(s[1]) and bool(q[1].float().isfinite().all())
    top = q[1].float().abs().amax()
    assert q[1, 5].float() == -top and (224 <= top <= 448 if pow2 else top == 448)
    assert bool(q[2].float().isfinite().all()) and bool((q[2].float().abs() <= 448).all())
    assert s[3] == float("inf")  # an inf input is not hidden: its scale says so


@pytest.mark.parametrize("pow2", [True, False])
def test_round_trip_error_is_half_a_step(pow2):
    """|x - q*s| <= half an e4m3 step: 2^-4 |x| in the normal range, s * 2^-10 in the subnormal one."""
    x = _wide_rows(33, 200, input_generator(), torch.float32)
    q, s = fp8.quantize_rows(x, pow2=pow2)
    err = (fp8.dequantize_rows(q, s) - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, s[:, None] * 2.0**-10) * (1 + 1e-6)
    assert bool((err <= bound).all())
    assert rel_err(fp8.dequantize_rows(q, s), x) < 0.04  # about 2.5% for Gaussian rows


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("R,C", [(1, 16), (37, 300), (130, 2048), (9, 3000), (5, 5000)])
def test_triton_quantization_equals_reference(R, C, pow2):
    x = _wide_rows(R, C, input_generator()) if R > 2 else torch.randn(R, C, generator=input_generator()).bfloat16()
    q, s = fp8.quantize_rows(x, pow2=pow2)
    q_ref, s_ref = fp8.quantize_rows_reference(x, pow2=pow2)
    assert q.dtype == fp8.E4M3 and q.is_contiguous() and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))  # bit-exact, signed zeros included


def test_triton_rounds_every_value_and_tie_like_the_cast():
    v = _all_e4m3_and_ties()
    row = torch.cat([v, torch.tensor([448.0])])[None]  # amax 448: scale exactly 1
    q, s = fp8.quantize_rows(row)
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8), row.to(fp8.E4M3).view(torch.uint8))


def test_strided_batched_and_row_bounded():
    gen = input_generator()
    w_EFD = torch.randn(3, 40, 72, generator=gen).bfloat16()
    view = w_EFD.transpose(1, 2)  # channels read across the stored rows
    q, s = fp8.quantize_rows(view)
    q_ref, s_ref = fp8.quantize_rows_reference(view)
    assert q.shape == (3, 72, 40) and s.shape == (3, 72) and q.is_contiguous()
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    x = torch.randn(50, 24, generator=gen)
    q, s = fp8.quantize_rows(x, num_rows=torch.tensor(17, dtype=torch.int32))
    q_ref, s_ref = fp8.quantize_rows_reference(x)
    assert torch.equal(s[:17], s_ref[:17]) and torch.equal(q[:17].view(torch.uint8), q_ref[:17].view(torch.uint8))


def test_quantize_operand_layout_and_error():
    b_EKM = torch.randn(4, 48, 32, generator=input_generator()).bfloat16()
    q, s = fp8.quantize_operand(b_EKM)
    assert q.shape == b_EKM.shape and q.stride(-2) == 1 and s.shape == (4, 32)  # column-major, one scale per m
    deq = q.float() * s[:, None, :]
    assert rel_err(deq, b_EKM.float()) < 0.04
    assert torch.equal(s, fp8.row_scales_reference(b_EKM.transpose(1, 2)))


def _plan(T, K, E, gen, skip=range(0)):
    return route_indices(random_idx(T, K, E, gen, skip), 0, E, impl="reference")


def test_scaled_grouped_mm_reference_is_the_dequantized_product():
    gen = input_generator()
    plan = _plan(90, 2, 8, gen, skip=range(2, 4))  # experts 2 and 3 get no rows
    N, Kd, M = plan.capacity, 48, 40
    aq, as_ = fp8.quantize_rows(torch.randn(N, Kd, generator=gen))
    bq, bs = fp8.quantize_operand(torch.randn(8, Kd, M, generator=gen))
    c = fp8.scaled_grouped_mm(aq, as_, bq, bs, plan, impl="reference")
    want = grouped_mm_reference(fp8.dequantize_rows(aq, as_).double(), (bq.float() * bs[:, None, :]).double(),
                                plan.counts_E, plan.offsets_E1)
    assert c.dtype == torch.bfloat16 and rel_err(c, want) < 4e-3  # one bf16 rounding of an fp32 product
    assert not fp8.fp8_gemm_supported("cpu")
    with pytest.raises(RuntimeError, match="sm90"):
        fp8.scaled_grouped_mm(aq, as_, bq, bs, plan, impl="torch")


@pytest.mark.parametrize("rows, groups, K, M, want", [
    (131072, 64, 2048, 2048, 131072),   # OLMoE, 16k tokens: 2048 rows per expert, already the large tiles
    (65536, 64, 1024, 2048, 131072),    # 8k tokens, the down GEMM: 1024 rows per expert -> presented as 2048
    (65536, 64, 2048, 1024, 131072),    # 8k tokens, dh
    (131072, 128, 2048, 1536, 262144),  # 128 experts of F 768, gate+up
    (131072, 64, 1024, 1024, 131072),   # K and M below 2048: no row count makes it large
    (8192, 64, 2048, 2048, 8192),       # 128 rows per expert: torch's small-shape tiles, left alone
    (32768, 64, 1024, 2048, 131072),    # 4k tokens: 512 rows per expert, 4x the rows
    (65536, 256, 2048, 1024, 65536),    # 256 rows per expert: 8x the rows would be needed, more memory than allowed
    (16384, 8, 4096, 28672, 16384),     # coarse: large already
])
def test_rows_to_present_picks_the_large_tiles_where_more_rows_can(rows, groups, K, M, want):
    got = fp8.rows_to_present(rows, groups, K, M)
    assert got == want and rows <= got <= fp8.MAX_PRESENTED_FACTOR * rows


def test_presented_rows_keep_the_operand_and_add_unread_ones():
    x = torch.randn(10, 4)
    assert fp8._with_rows(x, 10) is x
    y = fp8._with_rows(x, 32)
    assert y.shape == (32, 4) and torch.equal(y[:10], x)
    big = torch.randn(40, 4)  # a producer already allocated the presented rows: a view, no copy
    z = fp8._with_rows(big, 32)
    assert z.shape == (32, 4) and z.data_ptr() == big.data_ptr()


def test_operands_with_presented_rows_give_the_plans_rows():
    gen = input_generator()
    plan = _plan(50, 2, 4, gen)
    N, Kd, M = plan.capacity, 32, 16
    aq, as_ = fp8.quantize_rows(torch.randn(N, Kd, generator=gen))
    bq, bs = fp8.quantize_operand(torch.randn(4, Kd, M, generator=gen))
    long_q = torch.cat([aq, torch.zeros(3 * N, Kd, dtype=aq.dtype)])
    long_s = torch.cat([as_, torch.ones(3 * N)])
    c = fp8.scaled_grouped_mm(long_q, long_s, bq, bs, plan, impl="reference")
    assert c.shape == (N, M) and torch.equal(c, fp8.scaled_grouped_mm(aq, as_, bq, bs, plan, impl="reference"))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_producers_allocate_the_presented_rows(impl):
    gen = input_generator()
    plan = _plan(40, 2, 4, gen)
    N = plan.capacity
    x = torch.randn(40, 24, generator=gen)
    plain = gather.gather_rows(x, plan.row_token_N, plan.num_rows, impl=impl)
    long = gather.gather_rows(x, plan.row_token_N, plan.num_rows, impl=impl, capacity=3 * N)
    R = int(plan.num_rows)
    assert long.shape == (3 * N, 24) and torch.equal(long[:R], plain[:R])
    gu = torch.randn(N, 64, generator=gen).bfloat16()
    hq, hs = swiglu.swiglu_fwd_fp8(gu[:, :32], gu[:, 32:], plan.num_rows)
    hq3, hs3 = swiglu.swiglu_fwd_fp8(gu[:, :32], gu[:, 32:], plan.num_rows, capacity=3 * N)
    assert hq3.shape == (3 * N, 32) and hs3.shape == (3 * N,)
    assert torch.equal(hq3[:R].view(torch.uint8), hq[:R].view(torch.uint8)) and torch.equal(hs3[:R], hs[:R])


def test_gathered_rows_are_the_tokens_quantized_once():
    gen = input_generator()
    T, K, E, D = 60, 3, 6, 32
    idx = random_idx(T, K, E, gen)
    plan = route_indices(idx, 0, E)
    v_TD = torch.randn(T, D, generator=gen).bfloat16()
    q_TD, s_T = fp8.quantize_rows(v_TD)
    q_ND, s_N = _Fp8Gemms(plan, "reference").gathered_rows(v_TD)
    tok = plan.row_token_N.long()
    R = int(plan.num_rows)
    assert torch.equal(q_ND[:R].view(torch.uint8), q_TD[tok[:R]].view(torch.uint8))
    assert torch.equal(s_N[:R], s_T[tok[:R]])


@pytest.mark.parametrize("T,D,Fh,E,EG,e0,K,skip", [(200, 64, 32, 16, 16, 0, 4, range(3, 5)),
                                                    (96, 32, 48, 8, 16, 8, 2, range(0))])
def test_fp8_layer_is_within_fp8_error_of_the_bf16_reference(T, D, Fh, E, EG, e0, K, skip):
    """Output and every gradient within 10% relative L2 of experts_reference on the same bf16 inputs, and not within
    1% (a path that silently ran bf16 would be)."""
    gen = input_generator()
    idx = random_idx(T, K, EG, gen, skip)
    ts = [torch.randn(T, D, generator=gen), torch.rand(T, K, generator=gen), torch.randn(E, Fh, D, generator=gen) / 8,
          torch.randn(E, Fh, D, generator=gen) / 8, torch.randn(E, D, Fh, generator=gen) / 6]
    ts = [t.bfloat16() for t in ts]
    dy = torch.randn(T, D, generator=gen).bfloat16()

    def run(fn, **kw):
        ps = [t.clone().float().requires_grad_() for t in ts]
        y = fn(ps[0], idx, ps[1], *ps[2:], e_start=e0, **kw)
        return [y, *torch.autograd.grad(y, ps, dy.float())]

    got = run(fast_experts, gemm_impl="reference", precision="fp8")
    want = run(experts_reference)
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got[1:])
    for name, a, b in zip(("y", "dx", "dw_TK", "dw_gate", "dw_up", "dw_down"), got, want):
        assert 1e-2 < rel_err(a, b) < 0.1, name


def test_fp8_layer_keeps_the_tokens_not_their_gathered_rows_for_backward():
    """The bf16 rows x_ND only feed the weight gradients in the FP8 path: it keeps x_TD (T rows, not T*K) and gathers
    in the backward, and no path keeps y_ND (the SwiGLU backward takes the routing weight's gradient). Counted by the
    tensors autograd saves: bf16 keeps x_ND as its one [T*K, D] buffer, FP8 none."""
    gen = input_generator()
    T, D, Fh, E, K = 64, 32, 16, 8, 4
    idx = random_idx(T, K, E, gen)
    ps = [torch.randn(T, D, generator=gen), torch.rand(T, K, generator=gen), torch.randn(E, Fh, D, generator=gen),
          torch.randn(E, Fh, D, generator=gen), torch.randn(E, D, Fh, generator=gen)]
    ps = [p.bfloat16().requires_grad_() for p in ps]
    shapes: dict[str, list] = {"bf16": [], "fp8": []}
    for precision, saved in shapes.items():
        with torch.autograd.graph.saved_tensors_hooks(lambda t, out=saved: out.append(tuple(t.shape)) or t,
                                                      lambda t: t):
            y = fast_experts(ps[0], idx, ps[1], *ps[2:], gemm_impl="reference", precision=precision)
        y.float().sum().backward()
    assert shapes["bf16"].count((T * K, D)) == 1 and shapes["fp8"].count((T * K, D)) == 0
    assert (T, D) in shapes["fp8"]


def test_precision_config_is_checked():
    assert MoEConfig().precision == "bf16"
    MoEConfig(precision="fp8")  # impl auto: valid in the schema (the device is checked when the layer is built)
    for bad, key in ((dict(precision="fp16"), "model.moe.precision"),
                     (dict(precision="fp8", impl="reference"), "model.moe.precision")):
        with pytest.raises(ConfigError) as err:
            MoEConfig(**bad)
        assert err.value.key == key and "Fix:" in str(err.value)


def test_fp8_layer_is_refused_off_sm90_before_allocating(monkeypatch):
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, precision="fp8")

    def never(*a, **k):
        raise AssertionError("the layer started building before the precision check")

    with monkeypatch.context() as m:
        m.setattr(layer_mod, "Router", never)
        with torch.device("cpu"), pytest.raises(ConfigError) as err:
            layer_mod.MoELayer(16, cfg)
    assert err.value.key == "model.moe.precision" and "precision=bf16" in str(err.value)
    seen = []
    monkeypatch.setattr(layer_mod, "check_precision", lambda precision, device: seen.append((precision, device)))
    with torch.device("meta"):  # where build_model builds is the device checked
        built = layer_mod.MoELayer(16, cfg)
    assert seen == [("fp8", torch.device("meta"))]
    assert built.experts_fn.func is fast_experts
    assert built.experts_fn.keywords == {"precision": "fp8", "fuse_grad_accumulation": True}


def test_fp8_binds_the_kernels_precision():
    fn = layer_mod.resolve_experts_fn("auto", "fp8")
    assert fn.func is fast_experts and fn.keywords == {"precision": "fp8"}
    assert layer_mod.resolve_experts_fn("auto", "bf16") is layer_mod.auto_experts
    with pytest.raises(ValueError, match="precision"):
        fast_experts(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1),
                     *(torch.zeros(1, 4, 4),) * 3, precision="fp16")


def test_fp8_dims_are_checked_before_anything_runs():
    """The e4m3 operands' rows must be 16-byte aligned: a model dim or expert hidden size that is not a multiple of
    16 is a config error on the login node, and a clear ValueError for a direct caller of the kernels."""
    ModelConfig(d_model=128, moe=MoEConfig(expert_hidden=256, precision="fp8"))
    ModelConfig(d_model=120, n_heads=4, moe=MoEConfig(expert_hidden=200))  # bf16: any size
    for d_model, hidden, key in ((120, 256, "model.d_model"), (128, 200, "model.moe.expert_hidden")):
        with pytest.raises(ConfigError) as err:
            ModelConfig(d_model=d_model, n_heads=4, moe=MoEConfig(expert_hidden=hidden, precision="fp8"))
        assert err.value.key == key and "multiple of 16" in str(err.value) and "precision=bf16" in str(err.value)
    T, D, Fh, E, K = 8, 24, 16, 4, 2
    x, w_TK = torch.randn(T, D), torch.rand(T, K)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ws = (torch.randn(E, Fh, D), torch.randn(E, Fh, D), torch.randn(E, D, Fh))
    with pytest.raises(ValueError, match="multiples of 16"):
        fast_experts(x, idx, w_TK, *ws, precision="fp8")
    assert fast_experts(x, idx, w_TK, *ws, gemm_impl="reference", precision="fp8").shape == (T, D)  # emulated: any


def test_sizes_that_keep_the_expert_gemms_off_cutlass_are_named():
    """bf16 rows must be multiples of 8 elements for torch's grouped GEMM (16 bytes); the trainer warns, naming the
    keys, when a model's sizes send its expert GEMMs to the slower Triton fallback."""
    ok = ModelConfig(d_model=128, moe=MoEConfig(expert_hidden=256))
    odd = ModelConfig(d_model=132, n_heads=6, moe=MoEConfig(expert_hidden=100))
    assert layer_mod.slow_expert_sizes(ok, 2) == []
    assert layer_mod.slow_expert_sizes(odd, 2) == ["model.d_model=132", "model.moe.expert_hidden=100"]
    assert layer_mod.slow_expert_sizes(odd, 4) == []  # fp32: 4 elements per 16 bytes
    odder = ModelConfig(d_model=130, n_heads=5, moe=MoEConfig(expert_hidden=102))
    assert layer_mod.slow_expert_sizes(odder, 4) == ["model.d_model=130", "model.moe.expert_hidden=102"]
    layer_mod.warn_slow_expert_sizes(odd, torch.device("cpu"), torch.bfloat16)  # not a GPU: nothing to say


@pytest.mark.skipif(host_gpu_capability() != (9, 0), reason="needs an sm90 GPU (torch._scaled_grouped_mm)")
def test_presented_rows_on_the_gpu():
    """The compiled path with producer buffers longer than the plan's rows: gpu_fp8_presented.py in a process
    without TRITON_INTERPRET (this folder's tests interpret Triton)."""
    out = run_compiled("gpu_fp8_presented.py")
    assert out.startswith("ok "), out
