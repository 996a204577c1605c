"""Typed configuration of moe-launch.

Plain dataclasses, no Hydra: `conf/store.py` registers them in Hydra's ConfigStore at the edge, and the entry
points convert the composed config with `OmegaConf.to_object`, which runs every `__post_init__` below. Each check
names the dotted key and the fix, so a bad override fails before anything is allocated or written.

Field groups: `model` (architecture), `parallel` (dp × ep × pp, optimizer sharding), `train` (optimisation, schedule,
checkpoints, faults), `data`, `cluster` (local or Slurm, N nodes + B buffers), `health` (preflight), `supervisor`
(failure handling), `run` (name and output root).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from moe_launch.conf.checks import ConfigProblems, all_problems, one_of, require, validate_cross
from moe_launch.conf.moe_schema import MoEConfig

__all__ = ["ConfigProblems", "MoEConfig", "all_problems"]  # re-exported: callers use the schema module


def _xdg_path(var: str, fallback: str, rel: str) -> str:
    """A per-user state path under the XDG base directory `var` (as every Linux tool does), so a test suite or a
    second user setup can keep its own health history and baselines by setting XDG_DATA_HOME / XDG_CONFIG_HOME."""
    return f"{os.environ.get(var) or fallback}/moe-launch/{rel}"


FP8_DIM_MULTIPLE = 16  # torch._scaled_grouped_mm: every e4m3 operand's K and the bf16 outputs' rows 16-byte aligned


@dataclass
class ModelConfig:
    name: str = "tiny_moe"
    kind: str = "moe"  # dense | moe
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 512  # dense SwiGLU hidden size (kind=dense)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = True  # OLMoE normalises q and k (over the full projection) before RoPE
    init_std: float = 0.02
    # the output head's softmax, loss and logit gradient as one Triton kernel over each chunk's logits on CUDA
    # (kernels/cross_entropy.py), as Megatron-LM's cross-entropy loss fusion; false: torch's passes over an fp32 copy
    cross_entropy_fusion: bool = True
    # QK-norm and RoPE of q and of k as one Triton kernel each, forward and backward, on CUDA (kernels/norm_rope.py);
    # false: the norm and the rotation as separate modules (which torch.compile fuses, in two backward passes)
    qk_norm_rope_fusion: bool = True
    moe: MoEConfig = field(default_factory=MoEConfig)
    # "hf:/path" (safetensors + config.json), "ckpt:/path/model-step-N", or None for random init
    init_from: Optional[str] = None

    def __post_init__(self) -> None:
        one_of(self.kind, ("dense", "moe"), "model.kind")
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, key)
            require(value >= 1, f"model.{key}", f"got {value}", "use a positive integer")
        require(
            self.d_model % self.n_heads == 0,
            "model.n_heads",
            f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}",
            "choose n_heads dividing model.d_model",
        )
        require(
            (self.d_model // self.n_heads) % 2 == 0,
            "model.n_heads",
            f"head dim {self.d_model // self.n_heads} is odd (rotary embeddings rotate pairs)",
            "choose n_heads so that d_model / n_heads is even",
        )
        if self.kind == "moe" and self.moe.precision == "fp8":
            for key, dim in (("model.d_model", self.d_model), ("model.moe.expert_hidden", self.moe.expert_hidden)):
                require(dim % FP8_DIM_MULTIPLE == 0, key,
                        f"{dim} is not a multiple of {FP8_DIM_MULTIPLE}, which the FP8 expert GEMMs need (rows of "
                        "e4m3 operands 16-byte aligned)",
                        f"choose a multiple of {FP8_DIM_MULTIPLE}, or model.moe.precision=bf16")
        if self.init_from is not None:
            require(
                self.init_from.startswith(("hf:", "ckpt:")),
                "model.init_from",
                f"got {self.init_from!r}",
                "use hf:/path/to/hf_model_dir or ckpt:/path/to/checkpoints/model-step-N",
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ParallelConfig:
    dp: int = 1
    ep: int = 1
    pp: int = 1
    # none: plain replicated AdamW; zero1: state sharded over DP; epso: expert state over DP, the rest over DP×EP
    optimizer_sharding: str = "none"
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    pp_virtual_stages: int = 1  # >1 only with interleaved
    microbatches: int = 1  # PP micro-batches per step
    # layers per model chunk (pp * pp_virtual_stages entries); empty: balanced by pp_balance
    pp_split: list[int] = field(default_factory=list)
    # params (embedding / head weigh on the first / last chunk) | flops (forward FLOPs, MoE: top-k experts) | layers
    pp_balance: str = "params"

    def __post_init__(self) -> None:
        for key in ("dp", "ep", "pp", "pp_virtual_stages", "microbatches"):
            value = getattr(self, key)
            require(value >= 1, f"parallel.{key}", f"got {value}", "use a positive integer")
        one_of(self.optimizer_sharding, ("none", "zero1", "epso"), "parallel.optimizer_sharding")
        one_of(self.pp_schedule, ("gpipe", "1f1b", "interleaved"), "parallel.pp_schedule")
        one_of(self.pp_balance, ("flops", "params", "layers"), "parallel.pp_balance")
        if self.pp_split:
            chunks = self.pp * self.pp_virtual_stages
            require(len(self.pp_split) == chunks, "parallel.pp_split",
                     f"{len(self.pp_split)} entries for pp*pp_virtual_stages = {chunks} chunks",
                     "give one layer count per chunk, or leave it empty to balance")

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.pp


@dataclass
class FaultInjection:
    """Test hook, off by default: make `rank` misbehave at `step` (kind: nan | inf_grad | hang | crash | sigkill)."""

    kind: Optional[str] = None
    rank: int = 0
    step: int = 0
    # only inject on this attempt of the run (0 = first launch); a resumed run must not re-inject the same fault
    attempt: int = 0
    # only inject when running on this host (None = any); lets tests target a node
    host: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind is not None:
            kinds = ("nan", "inf_grad", "hang", "crash", "sigkill", "kill_during_ckpt", "loss_spike")
            one_of(self.kind, kinds, "train.fault_injection.kind")


@dataclass
class SpikeConfig:
    """Loss / gradient-norm spike detection (trainer/spike.py): a value above median + threshold * 1.4826 * MAD of the
    last `window` steps is a spike."""

    action: Optional[str] = None  # None (detection off) | skip (drop the update) | rollback | stop
    window: int = 50  # steps of history; nothing is judged before it is full
    threshold: float = 6.0  # in robust standard deviations (1.4826 * MAD)
    skip_batches: int = 1  # rollback: batches, ending at the spike's, that the restarted run never reads

    def __post_init__(self) -> None:
        if self.action is not None:
            one_of(self.action, ("skip", "rollback", "stop"), "train.spike.action")
        require(self.window >= 3, "train.spike.window", f"got {self.window}", "use at least 3 steps (e.g. 50)")
        require(self.threshold > 0, "train.spike.threshold", f"got {self.threshold}", "use e.g. 6.0")
        require(self.skip_batches >= 1, "train.spike.skip_batches", f"got {self.skip_batches}", "use 1 or more")


@dataclass
class TrainConfig:
    steps: int = 60
    global_batch_size: int = 8  # sequences per optimizer step, over all DP ranks
    micro_batch_size: int = 4  # sequences per forward/backward on one rank
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | wsd | constant
    wsd_decay_fraction: float = 0.2  # WSD: last fraction of steps decays linearly to min_lr
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables
    clip_after_warmup_only: bool = False
    seed: int = 1234
    deterministic: bool = False
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # dtype of the model's parameters (and gradients): auto | fp32 | bf16. auto = bf16 whenever the compute dtype
    # (train.dtype, resolved on the device) is bf16, else fp32. bf16 parameters keep the fp32 master weights and
    # moments inside the optimizer (trainer/parallel/optimizer.py), so autocast does not re-cast every weight in every
    # micro-batch and weights + gradients take half the memory; gradients then accumulate over micro-batches in bf16
    # and the residual stream is bf16. fp32 keeps fp32 parameters under bf16 autocast (the conservative choice).
    param_dtype: str = "auto"
    ckpt_interval: int = 20  # dual alternating full checkpoints every N steps (0 disables)
    model_ckpt_interval: int = 0  # persistent model-only checkpoints every M steps (0 disables)
    # a full checkpoint falls due while the previous one is still being written (in the background): wait (training
    # blocks until it is durable, every checkpoint is taken) | skip (training goes on; the next due one is taken and
    # the journal notes the skipped step). A preemption / time-limit checkpoint and the final one always wait
    ckpt_when_busy: str = "wait"
    # after a start from a model-only checkpoint (model.init_from=ckpt:, or a spike rollback) with its fresh
    # optimizer: the learning rate ramps up linearly over this many steps (0: the schedule's own value at once)
    rewarmup_steps: int = 0
    # the expert stage of a micro-batch must fit in this fraction of the device memory; when its worst case (every
    # routed row landing on this rank) would not, it runs in checkpointed row chunks (trainer/moe/skew.py)
    max_memory_fraction: float = 0.9
    expert_load_alert: float = 4.0  # journal a layer whose global max/mean expert load exceeds this (0: never)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    log_interval: int = 1
    # held-out evaluation (trainer/evaluate.py): the lm loss over the first eval_batches global batches of
    # data.eval_path, every eval_interval steps and after the last step (0: never)
    eval_interval: int = 0
    eval_batches: int = 4
    recompute: list[str] = field(default_factory=list)  # any of norm, attention, moe, mlp; or [full]
    # torch.compile of attention and norms (trainer/compile.py); None: on for CUDA, off on CPU. Compiled code is kept
    # in the run directory (compile_cache/), so a restart loads it instead of compiling again
    compile: Optional[bool] = None
    # tracking backends fed from metrics.jsonl (trainer/tracking/tracker.py): tensorboard (skipped with a warning when
    # not installed) and/or wandb (WANDB_MODE=offline for local files only); [] for none
    tracking: list[str] = field(default_factory=lambda: ["tensorboard"])
    # peak FLOP/s of ONE device for the `mfu` metric; 0: the data-sheet bf16 peak of a known GPU (none on CPU)
    peak_flops: float = 0.0
    progress: bool = True  # rich's progress bar on rank 0 when stdout is a terminal (log lines are always written)
    step_sleep_s: float = 0.0  # slows the demo/tests down so faults can be injected mid-run
    fault_injection: FaultInjection = field(default_factory=FaultInjection)

    def __post_init__(self) -> None:
        for key in ("steps", "global_batch_size", "micro_batch_size", "seq_len", "log_interval"):
            value = getattr(self, key)
            require(value >= 1, f"train.{key}", f"got {value}", "use a positive integer")
        require(self.lr > 0, "train.lr", f"got {self.lr}", "use a positive learning rate")
        require(0 <= self.min_lr <= self.lr, "train.min_lr", f"got {self.min_lr} with lr={self.lr}",
                 "use 0 <= min_lr <= lr")
        require(self.warmup_steps >= 0, "train.warmup_steps", f"got {self.warmup_steps}", "use a value >= 0")
        one_of(self.schedule, ("cosine", "wsd", "constant"), "train.schedule")
        require(0 < self.wsd_decay_fraction <= 1, "train.wsd_decay_fraction", "out of (0, 1]", "use e.g. 0.2")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1", "betas must lie in [0, 1)",
                 "use 0.9 / 0.95")
        require(self.eps > 0, "train.eps", f"got {self.eps}", "use e.g. 1e-8")
        require(self.weight_decay >= 0, "train.weight_decay", "is negative", "use a value >= 0")
        require(self.grad_clip >= 0, "train.grad_clip", "is negative", "use 0 to disable or a positive norm")
        one_of(self.dtype, ("auto", "fp32", "bf16"), "train.dtype")
        one_of(self.param_dtype, ("auto", "fp32", "bf16"), "train.param_dtype")
        require(not (self.param_dtype == "bf16" and self.dtype == "fp32"), "train.param_dtype",
                 "bf16 parameters need bf16 compute, but train.dtype=fp32",
                 "set train.dtype=bf16 (or auto on GPU), or train.param_dtype=fp32 / auto")
        require(self.ckpt_interval >= 0, "train.ckpt_interval", "is negative", "use 0 to disable or a step count")
        require(self.model_ckpt_interval >= 0, "train.model_ckpt_interval", "is negative", "use 0 or a step count")
        one_of(self.ckpt_when_busy, ("wait", "skip"), "train.ckpt_when_busy")
        require(self.rewarmup_steps >= 0, "train.rewarmup_steps", "is negative", "use 0 or a step count")
        require(0 < self.max_memory_fraction <= 1, "train.max_memory_fraction", f"got {self.max_memory_fraction}",
                 "use a fraction in (0, 1], e.g. 0.9")
        require(self.expert_load_alert >= 0, "train.expert_load_alert", "is negative", "use 0 (off) or e.g. 4.0")
        require(self.spike.action != "rollback" or self.model_ckpt_interval > 0, "train.spike.action",
                 "rollback restarts from a persistent model checkpoint, but train.model_ckpt_interval=0 writes none",
                 "set train.model_ckpt_interval (e.g. 100), or use train.spike.action=skip / stop")
        for i, item in enumerate(self.recompute):
            one_of(item, ("norm", "attention", "moe", "mlp", "full"), f"train.recompute[{i}]")
        require(self.step_sleep_s >= 0, "train.step_sleep_s", "is negative", "use a value >= 0")
        require(self.eval_interval >= 0, "train.eval_interval", "is negative", "use 0 (never) or a step count")
        require(self.eval_batches >= 1, "train.eval_batches", f"got {self.eval_batches}", "use a positive integer")
        for i, item in enumerate(self.tracking):
            one_of(item, ("tensorboard", "wandb"), f"train.tracking[{i}]")
        require(self.peak_flops >= 0, "train.peak_flops", "is negative", "use 0 (data-sheet peak) or FLOP/s")


@dataclass
class DataConfig:
    # directory holding index.json + shard-*.npy (moe-data prepare), or a Megatron prefix (path.bin + path.idx);
    # None: the built-in corpus, tokenized on first use into data.cache_dir
    path: Optional[str] = None
    # held-out sequences for train.eval_interval, prepared like data.path and read in data.format; never trained on
    eval_path: Optional[str] = None
    format: str = "npy"  # npy | megatron
    tokenizer: str = "builtin"  # builtin (byte-level BPE trained on the built-in corpus) | /path/to/tokenizer.json
    cache_dir: str = "~/.cache/moe-launch/data"
    shard_size: int = 4096  # instances per shard file
    workers: int = 2  # tokenization processes (or Slurm array tasks with cluster=slurm)
    seed: int = 0  # prepare-time shuffle of the built-in dataset (epoch orders come from train.seed)

    def __post_init__(self) -> None:
        one_of(self.format, ("npy", "megatron"), "data.format")
        require(self.shard_size >= 1, "data.shard_size", f"got {self.shard_size}", "use a positive integer")
        require(self.workers >= 1, "data.workers", f"got {self.workers}", "use a positive integer")


@dataclass
class ClusterConfig:
    kind: str = "local"  # local (process groups on this machine) | slurm
    nodes: int = 1  # N: nodes the trainer runs on
    buffers: int = 0  # B: spare nodes allocated with the job, swapped in on failure
    tasks_per_node: int = 1  # trainer ranks per node (GPUs per node on a GPU cluster)
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_per_node_mb: int = 0  # 0: let Slurm decide
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_limit_min: int = 60
    exclude: list[str] = field(default_factory=list)
    name: str = "local"  # cluster name for health baselines and history
    python: Optional[str] = None  # interpreter on the compute nodes (default: the one running moe-launch)
    extra_sbatch: list[str] = field(default_factory=list)  # extra "--key=value" lines, each quoted when rendered
    # --signal=B:USR2@N: checkpoint and exit before the time limit. 0: no warning; the limit's SIGTERM then saves a
    # checkpoint only if the step in flight and the write fit in the cluster's KillWait
    signal_before_end_s: int = 60
    # srun/sbatch/scontrol/sacct answers such as "Unable to contact slurm controller" are retried with backoff for
    # this long before they count as an error: a slurmctld restart or failover must not end a run
    controller_retry_s: float = 300.0

    def __post_init__(self) -> None:
        one_of(self.kind, ("local", "slurm"), "cluster.kind")
        require(self.signal_before_end_s >= 0, "cluster.signal_before_end_s", f"got {self.signal_before_end_s}",
                 "use seconds >= 0 (0: no warning signal)")
        require(self.controller_retry_s >= 0, "cluster.controller_retry_s", f"got {self.controller_retry_s}",
                 "use seconds >= 0, e.g. 300")
        require(self.nodes >= 1, "cluster.nodes", f"got {self.nodes}", "use at least 1 node")
        require(self.buffers >= 0, "cluster.buffers", f"got {self.buffers}", "use 0 or more buffer nodes")
        require(self.tasks_per_node >= 1, "cluster.tasks_per_node", f"got {self.tasks_per_node}", "use at least 1")
        require(self.time_limit_min >= 1, "cluster.time_limit_min", f"got {self.time_limit_min}", "use minutes >= 1")
        for i, arg in enumerate(self.extra_sbatch):
            require(arg.startswith("--"), f"cluster.extra_sbatch[{i}]", f"got {arg!r}", "write options as --key=value")


@dataclass
class DcgmConfig:
    enabled: bool = True
    required: bool = False  # dcgmi absent: block the node (True) or accept it as `unavailable` (False)
    level: int = 1
    timeout_s: int = 600

    def __post_init__(self) -> None:
        require(self.level in (1, 2, 3, 4), "health.dcgm.level", f"got {self.level}", "use 1, 2, 3 or 4")


@dataclass
class AllToAllConfig:
    enabled: bool = True
    threshold: float = 0.9  # fraction of the stored baseline bandwidth that passes
    min_bytes: int = 1024
    max_bytes: int = 0  # 0: 8 GiB on GPU, 1 MiB on CPU
    iters: int = 5
    baseline_path: str = field(default_factory=lambda: _xdg_path("XDG_CONFIG_HOME", "~/.config", "a2a_baselines.json"))
    isolate: bool = True  # on failure, find the bad node(s) by leave-one-out / pairwise tests
    timeout_s: int = 300

    def __post_init__(self) -> None:
        require(0 < self.threshold <= 1, "health.alltoall.threshold", f"got {self.threshold}", "use e.g. 0.9")
        require(self.iters >= 1, "health.alltoall.iters", f"got {self.iters}", "use at least 1")


@dataclass
class HealthConfig:
    preflight: bool = True
    dcgm: DcgmConfig = field(default_factory=DcgmConfig)
    gpu_check: bool = True
    gpu_check_threshold: float = 0.9  # GPU only: GEMM TFLOP/s below this fraction of the model's baseline fails
    alltoall: AllToAllConfig = field(default_factory=AllToAllConfig)
    # per-cluster history (JSON lines) and quarantine list
    store_dir: str = field(default_factory=lambda: _xdg_path("XDG_DATA_HOME", "~/.local/share", "health"))
    quarantine_failures: int = 3  # k failures of a node within the window -> quarantined
    quarantine_window_h: float = 24.0
    # test hook: host -> seconds of delay added to that host's all-to-all (simulates a slow link)
    inject_delay: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(self.quarantine_failures >= 1, "health.quarantine_failures", "must be >= 1", "use e.g. 3")
        require(0 < self.gpu_check_threshold <= 1, "health.gpu_check_threshold", f"got {self.gpu_check_threshold}",
                 "use e.g. 0.9")


@dataclass
class SupervisorConfig:
    # no heartbeat for this long = a hang; plus 10 s, the trainer's collective timeout (NCCL / gloo),
    # so a collective stuck on a dead peer fails by then. Must exceed the longest step and checkpoint write
    hang_timeout_s: float = 120.0
    max_restarts: int = 5
    # login side: new allocations after an allocation was lost without a clean checkpoint (its supervisor's node
    # died, a hard time limit). Continuations after a clean time-limit/preemption checkpoint do not count
    max_resubmits: int = 2
    max_allocations: int = 0  # cap on all allocations of the run, continuations included; 0: no cap
    poll_s: float = 0.5
    launch_timeout_s: float = 300.0  # time allowed for the first heartbeat after a (re)launch
    # warm trainer processes kept ready for relaunches (orchestrator/standby.py): off | buffers (on every buffer
    # node) | all (also on the active nodes, so every rank of a relaunch starts warm; a second model copy per node)
    standby: str = "buffers"
    # after a task of the trainer step exits badly, nodes whose tasks have not reported within this many seconds are
    # taken as dead (their slurmstepd is gone): no waiting for Slurm's node timeout
    exit_grace_s: float = 1.5
    # argv that replaces `python -m moe_launch.trainer` (empty: the embedded trainer); tests point it at stand-ins
    trainer_command: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        require(self.hang_timeout_s > 0, "supervisor.hang_timeout_s", "must be positive", "use seconds, e.g. 120")
        require(self.max_restarts >= 0, "supervisor.max_restarts", "is negative", "use 0 or more")
        require(self.max_resubmits >= 0, "supervisor.max_resubmits", "is negative", "use 0 or more")
        require(self.max_allocations >= 0, "supervisor.max_allocations", "is negative", "use 0 (no cap) or more")
        require(self.poll_s > 0, "supervisor.poll_s", "must be positive", "use e.g. 0.5")
        one_of(self.standby, ("off", "buffers", "all"), "supervisor.standby")
        require(self.exit_grace_s > 0, "supervisor.exit_grace_s", "must be positive", "use seconds, e.g. 3")


@dataclass
class RunConfig:
    name: str = "run"  # the Hydra app defaults this to a timestamp
    root: str = "runs"

    def __post_init__(self) -> None:
        check_run_name(self.name)


def check_run_name(name: str) -> None:
    """The run's directory name: one path component. Also checked on the command line, before Hydra creates the
    directory."""
    bad = set(name) & set("/\\\0") or name in ("", ".", "..")
    require(not bad, "run.name", f"{name!r} is not a valid directory name", "use letters, digits, - and _")


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dry_run: bool = False
    # print a job script for submission by hand and exit: "run" (the supervised run) | "preflight" (health checks only)
    render_sbatch: Optional[str] = None

    def __post_init__(self) -> None:
        validate_cross(self)
