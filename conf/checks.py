"""The config checks: one bad value is a ConfigError naming the dotted key, the problem and the fix (`require`);
inside `all_problems()` they are collected so that every bad value is reported at once. `validate_cross` holds the
checks that involve more than one group. conf/schema.py and conf/moe_schema.py call them from their dataclasses'
`__post_init__`.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Iterator, Optional

from moe_launch.errors import ConfigError

if TYPE_CHECKING:
    from moe_launch.conf.schema import RootConfig

# set by `all_problems()`: the checks below record into this list instead of raising at the first problem
_found: ContextVar[Optional[list[ConfigError]]] = ContextVar("config_problems", default=None)


class ConfigProblems(ConfigError):
    """Several bad values at once, one line each, so a user fixes them in one edit instead of one per try."""

    def __init__(self, problems: list[ConfigError]):
        self.problems = problems
        ValueError.__init__(self, f"{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))
        self.key = problems[0].key


@contextmanager
def all_problems() -> Iterator[None]:
    """Convert a config inside this block (OmegaConf.to_object runs every __post_init__): every failed check is
    collected, and one ConfigError (ConfigProblems when more than one) names them all at the end."""
    token = _found.set([])
    try:
        yield
    except ConfigError as e:  # raised directly, not through _require: it joins the others
        _found.get().append(e)
    except Exception:  # a check that tripped over an earlier bad value: the recorded problems explain it
        if not _found.get():
            raise
    finally:
        found = _found.get()
        _found.reset(token)
    if len(found) == 1:
        raise found[0]
    if found:
        raise ConfigProblems(found)


def require(cond: bool, key: str, problem: str, fix: str) -> None:
    if not cond:
        found = _found.get()
        if found is None:
            raise ConfigError(key, problem, fix)
        found.append(ConfigError(key, problem, fix))


def one_of(value: str, allowed: tuple[str, ...], key: str) -> None:
    require(value in allowed, key, f"got {value!r}", f"use one of {', '.join(allowed)}")


def validate_cross(cfg: RootConfig) -> None:
    """Checks that involve more than one group. Pure; raises ConfigError."""
    if cfg.render_sbatch is not None:
        one_of(cfg.render_sbatch, ("run", "preflight"), "render_sbatch")
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.cluster
    if m.kind == "moe":
        require(
            m.moe.num_experts % p.ep == 0,
            "parallel.ep",
            f"{m.moe.num_experts} experts cannot be split over ep={p.ep}",
            f"choose ep dividing model.moe.num_experts ({m.moe.num_experts})",
        )
    else:
        require(p.ep == 1, "parallel.ep", f"got {p.ep} for a dense model", "use parallel.ep=1 with model.kind=dense")
    require(
        m.n_layers % p.pp == 0 or p.pp <= m.n_layers,
        "parallel.pp",
        f"pp={p.pp} exceeds n_layers={m.n_layers}",
        "use pp <= model.n_layers",
    )
    if t.eval_interval:
        require(cfg.data.eval_path is not None, "data.eval_path",
                f"train.eval_interval={t.eval_interval} evaluates on held-out data, but none is set",
                "set data.eval_path to a dataset prepared like data.path (moe-data prepare), or train.eval_interval=0")
        require(p.pp == 1, "train.eval_interval", "held-out evaluation does not run under pipeline parallelism",
                "set train.eval_interval=0, or parallel.pp=1")
    world = c.nodes * c.tasks_per_node
    require(
        p.world_size == world,
        "parallel.dp",
        f"dp*ep*pp = {p.dp}*{p.ep}*{p.pp} = {p.world_size} but the cluster gives "
        f"cluster.nodes*cluster.tasks_per_node = {c.nodes}*{c.tasks_per_node} = {world} ranks",
        "make parallel.dp * parallel.ep * parallel.pp equal cluster.nodes * cluster.tasks_per_node",
    )
    # EP ranks read different tokens (they are data-parallel for everything but the experts)
    per_step = p.dp * p.ep * t.micro_batch_size
    require(
        t.global_batch_size % per_step == 0,
        "train.global_batch_size",
        f"{t.global_batch_size} is not a multiple of parallel.dp*parallel.ep*train.micro_batch_size = {per_step}",
        f"use a multiple of {per_step}",
    )
    require(
        t.seq_len <= m.max_seq_len,
        "train.seq_len",
        f"{t.seq_len} is above the model's max_seq_len={m.max_seq_len}",
        "lower train.seq_len or raise model.max_seq_len",
    )
    fi = t.fault_injection
    if fi.kind is not None:
        require(0 <= fi.rank < p.world_size, "train.fault_injection.rank", f"rank {fi.rank} does not exist",
                 f"use 0..{p.world_size - 1}")
    if c.kind == "slurm":
        interval_min = 0.0
        require(
            c.time_limit_min > interval_min,
            "cluster.time_limit_min",
            "too short for one checkpoint interval",
            "raise the time limit",
        )
    if p.pp > 1:
        require(
            p.microbatches >= p.pp or p.pp_schedule == "gpipe",
            "parallel.microbatches",
            f"{p.microbatches} micro-batches cannot fill {p.pp} pipeline stages",
            f"use parallel.microbatches >= {p.pp}",
        )
    if p.pp_virtual_stages > 1:
        require(p.pp_schedule == "interleaved", "parallel.pp_virtual_stages", "needs the interleaved schedule",
                 "set parallel.pp_schedule=interleaved or pp_virtual_stages=1")
    if p.pp > 1:
        # the pipeline's micro-batches are the gradient-accumulation micro-batches of train.micro_batch_size sequences
        accum = t.global_batch_size // per_step
        require(p.microbatches == accum, "parallel.microbatches",
                 f"{p.microbatches}, but train.global_batch_size / (dp*ep*train.micro_batch_size) = {accum} "
                 "micro-batches run through each pipeline per step",
                 f"set parallel.microbatches={accum} or change train.micro_batch_size / global_batch_size")
        if not p.pp_split:
            chunks = p.pp * p.pp_virtual_stages
            require(m.n_layers >= chunks, "parallel.pp", f"{m.n_layers} layers cannot fill pp*pp_virtual_stages = "
                     f"{chunks} chunks", "lower parallel.pp / pp_virtual_stages, or give parallel.pp_split")
