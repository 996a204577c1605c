"""`train.compile=true` in the Trainer: trainer/compile.py's compile_model is applied to the built model (the wiring
only: tracing happens at the first forward, and tests/perf/test_compile.py checks the compiled numerics)."""

from __future__ import annotations

import torch
from trainer_harness import tiny_cfg, write_run

from moe_launch.trainer.loop import Trainer

torch.set_num_threads(1)


def test_train_compile_compiles_the_dense_parts_in_place(data_cache, tmp_path):
    cfg = tiny_cfg(data_cache, compile=True, dtype="bf16", param_dtype="bf16")
    trainer = Trainer(cfg, write_run(tmp_path / "r", cfg))
    block = trainer.model.blocks[0]
    assert block.attn._compiled_call_impl is not None and block.attn_norm._compiled_call_impl is not None
    assert block.ffn._compiled_call_impl is None  # the MoE layer stays eager
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
