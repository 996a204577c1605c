"""Named presets for each config group (the choices of `model=…`, `cluster=…`, …). Pure data, no Hydra."""

from __future__ import annotations

from moe_launch.conf.schema import (
    ClusterConfig,
    DataConfig,
    HealthConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)

MODELS: dict[str, ModelConfig] = {
    # CPU-sized: the embedded demo and the tests
    "tiny_moe": ModelConfig(
        name="tiny_moe", kind="moe", vocab_size=4096, d_model=128, n_layers=2, n_heads=4, max_seq_len=256,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=256),
    ),
    "tiny_dense": ModelConfig(
        name="tiny_dense", kind="dense", vocab_size=4096, d_model=128, n_layers=2, n_heads=4, ffn_hidden=512,
        max_seq_len=256,
    ),
    # allenai/OLMoE-1B-7B-0924
    "olmoe_1b7b": ModelConfig(
        name="olmoe_1b7b", kind="moe", vocab_size=50304, d_model=2048, n_layers=16, n_heads=16, max_seq_len=4096,
        moe=MoEConfig(num_experts=64, top_k=8, expert_hidden=1024, norm_topk_prob=False, aux_loss_coef=1e-2,
                      z_loss_coef=1e-3),
    ),
    # allenai/OLMo-1B-hf shape (dense, FFN 8192)
    "olmo_1b": ModelConfig(
        name="olmo_1b", kind="dense", vocab_size=50304, d_model=2048, n_layers=16, n_heads=16, ffn_hidden=8192,
        max_seq_len=4096, qk_norm=False,
    ),
}

CLUSTERS: dict[str, ClusterConfig] = {
    # groups of local processes stand in for nodes: the whole supervise/swap/resume loop on one machine
    "local": ClusterConfig(kind="local", nodes=2, buffers=1, tasks_per_node=1, name="local"),
    # a Slurm cluster; the defaults fit the project's local test cluster (tests/slurm/cluster.sh)
    "slurm": ClusterConfig(kind="slurm", nodes=2, buffers=1, tasks_per_node=1, cpus_per_task=1, name="local-slurm",
                           time_limit_min=30),
}

PARALLEL: dict[str, ParallelConfig] = {
    "default": ParallelConfig(dp=2, ep=1, pp=1),
    "single": ParallelConfig(dp=1, ep=1, pp=1),
}

TRAIN: dict[str, TrainConfig] = {
    "default": TrainConfig(),
    # Optimus schedule: 4e-4 -> 4e-5 cosine after 2,500 warm-up steps
    "optimus": TrainConfig(steps=100_000, lr=4e-4, min_lr=4e-5, warmup_steps=2500, seq_len=4096,
                           global_batch_size=1024, micro_batch_size=4, ckpt_interval=500, model_ckpt_interval=5000),
}

DATA: dict[str, DataConfig] = {"builtin": DataConfig()}

HEALTH: dict[str, HealthConfig] = {"default": HealthConfig()}
