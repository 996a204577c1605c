"""`train.compile` (trainer/compile.py): the compiled dense parts give the eager loss and every gradient within fp32
rounding, alone and together with `train.recompute`; parameter names stay; all layers share one graph per module
kind (no per-layer recompiles); a pipeline stage (blocks in a ModuleDict) is covered as a Transformer is. Also the
cheaper eager pieces that compile traces: RoPE's hand-written backward equals autograd of the rotate-half formula.

Inductor on CPU compiles C++ with gcc: the first test costs ~15-30 s (two small graphs), later ones reuse them or
Inductor's on-disk cache."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from moe_launch.conf.schema import ModelConfig, MoEConfig
from moe_launch.trainer.compile import compile_model, compile_targets
from moe_launch.trainer.model import build_model
from moe_launch.trainer.model.rope import Rotary, apply_rotary
from moe_launch.trainer.pipeline.stage import build_stage_model
from moe_launch.trainer.recompute import apply_recompute

torch.set_num_threads(1)

CFG = ModelConfig(name="compile_test", kind="moe", vocab_size=512, d_model=32, n_layers=3, n_heads=4, max_seq_len=16,
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24))


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens_BS = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1), generator=g)
    return tokens_BS[:, :-1], tokens_BS[:, 1:]


def _loss_and_grads(model):
    inputs_BS, targets_BS = _batch()
    loss, _ = model.compute_loss(inputs_BS, targets_BS)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _model():
    torch.manual_seed(7)
    return build_model(CFG)


def _assert_same(got, want):
    loss, grads = got
    ref_loss, ref_grads = want
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def _rotate_half_formula(x_BHSDh, rotary):
    """OLMo / HF Llama's RoPE as written there, in fp32: x * cos + rotate_half(x) * sin."""
    S, P = x_BHSDh.shape[-2], x_BHSDh.shape[-1] // 2
    cos, sin = rotary.cos_SDh[:S], rotary.sin_signed_SDh[:S, P:].repeat(1, 2)
    x = x_BHSDh.float()
    return (x * cos + torch.cat([-x[..., P:], x[..., :P]], dim=-1) * sin).to(x_BHSDh.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_forward_and_backward_equal_the_formula(dtype):
    rotary = Rotary(head_dim=16, max_seq_len=64, theta=10000.0)
    g = torch.Generator().manual_seed(3)
    # heads as the attention makes them: a transposed view of [B, S, H, Dh]
    x = torch.randn(2, 50, 3, 16, generator=g).transpose(1, 2).to(dtype).requires_grad_()
    dy = torch.randn(2, 3, 50, 16, generator=g).to(dtype)
    y = rotary(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = _rotate_half_formula(x_ref, rotary)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy)
    # fp32: rounding order only (addcmul may fuse the multiply-add); bf16: at most one bf16 ulp from that
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    assert y.dtype == dx.dtype == dtype
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)
    x64 = torch.randn(1, 2, 5, 16, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, rotary.cos_SDh.double(), rotary.sin_signed_SDh.double()),
                                    (x64,))


def test_targets_of_transformer_and_pipeline_stage():
    names = [n for n, _ in compile_targets(_model())]
    per_block = [f"blocks.{i}.{m}" for i in range(CFG.n_layers) for m in ("attn_norm", "attn", "ffn_norm")]
    assert names == per_block + ["norm"]
    torch.manual_seed(7)
    last = build_stage_model(CFG, {1: range(1, 3)}, n_chunks=2)  # layers 1, 2 + final norm, keyed "1", "2"
    assert [n for n, _ in compile_targets(last)] == [f"blocks.{i}.{m}" for i in (1, 2)
                                                    for m in ("attn_norm", "attn", "ffn_norm")] + ["norm"]
    first = build_stage_model(CFG, {0: range(0, 1)}, n_chunks=2)  # no final norm on the first stage
    assert [n for n, _ in compile_targets(first)] == ["blocks.0.attn_norm", "blocks.0.attn", "blocks.0.ffn_norm"]
    compile_model(first)
    assert all(m._compiled_call_impl is not None for _, m in compile_targets(first))
    assert first.embed._compiled_call_impl is None and first.blocks["0"].ffn._compiled_call_impl is None


def test_compiled_equals_eager_and_one_graph_per_module_kind():
    want = _loss_and_grads(_model())
    model = _model()
    keys = list(model.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compile_model(model)
    compile_model(model)  # a second call changes nothing
    _assert_same(_loss_and_grads(model), want)
    assert list(model.state_dict()) == keys
    # 3 blocks + final norm: one graph for RMSNorm and one for Attention, whatever the depth
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]
    model.zero_grad()
    _assert_same(_loss_and_grads(model), want)  # the second step reuses them
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("kinds", [["norm", "attention", "moe"], ["full"]])
@pytest.mark.parametrize("recompute_first", [True, False])
def test_compile_with_recompute(kinds, recompute_first):
    want = _loss_and_grads(_model())
    model = _model()
    if recompute_first:  # the Trainer's order
        apply_recompute(model, kinds)
        compile_model(model)
    else:
        compile_model(model)
        apply_recompute(model, kinds)
    _assert_same(_loss_and_grads(model), want)
    compiled = [m for _, m in compile_targets(model)]
    assert all(m._compiled_call_impl is not None for m in compiled)
    checkpointed = [n for n, m in model.named_modules() if getattr(m, "_recompute", False)]
    assert checkpointed and all(not n.endswith("ffn") or "moe" in kinds for n in checkpointed)


def _saved_bytes_of_attention_sublayer(model) -> int:
    """Bytes that the autograd graph keeps for the backward of block 0's `attn(attn_norm(x))`, compiled regions
    included; parameters and buffers (rotary tables) are not counted: they are kept anyway."""
    kept = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    total = 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in kept:
            total += t.numel() * t.element_size()
        return t

    block = model.blocks[0]
    x_BSD = torch.randn(2, CFG.max_seq_len, CFG.d_model, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y_BSD = block.attn(block.attn_norm(x_BSD))
    y_BSD.sum().backward()
    return total


def test_recompute_still_drops_activations_when_compiled():
    plain, recomputed = _model(), _model()
    compile_model(plain)
    apply_recompute(recomputed, ["attention"])
    compile_model(recomputed)
    # kept without recompute: normed x, q / k / v, QK-norm statistics, rotated q / k, SDPA output and logsumexp;
    # with it: the attention's input (the normed x) and the norm's own saved tensors, about a quarter of that
    assert _saved_bytes_of_attention_sublayer(recomputed) < _saved_bytes_of_attention_sublayer(plain) / 2


def test_trainer_with_compile_and_recompute_follows_the_eager_run(tmp_path):
    """The real Trainer, train.compile + train.recompute together, against the same run eager: same losses."""
    from moe_launch.conf.schema import ClusterConfig, DataConfig, ParallelConfig, RootConfig, TrainConfig
    from moe_launch.rundir import EXIT_OK, RunDir, read_jsonl
    from moe_launch.trainer.loop import Trainer

    def run(name: str, **train) -> list[float]:
        cfg = RootConfig(model=CFG, parallel=ParallelConfig(dp=1),
                         train=TrainConfig(steps=3, global_batch_size=4, micro_batch_size=2, seq_len=CFG.max_seq_len,
                                           lr=3e-3, warmup_steps=1, ckpt_interval=0, progress=False, **train),
                         data=DataConfig(cache_dir=str(tmp_path / "cache"), workers=1), cluster=ClusterConfig(nodes=1))
        rd = RunDir(tmp_path / name)
        assert Trainer(cfg, rd).train() == EXIT_OK
        return [r["loss"] for r in read_jsonl(rd.metrics)]

    eager = run("eager")
    both = run("both", compile=True, recompute=["norm", "attention", "moe"])
    assert len(both) == len(eager) == 3
    torch.testing.assert_close(both, eager, rtol=1e-5, atol=1e-5)
