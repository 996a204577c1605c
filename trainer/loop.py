"""The Trainer: build, resume, then `train_step` until done; faults, preemption and checkpoints at step ends.

One optimizer step (`_step`):
  forward/backward over the micro-batches of this rank's slice of the global batch (loss / accum steps)
  -> local fault check (own loss, own gradients, before the reduction could spread a NaN)
  -> one all-reduce of [fault flag per rank | stop flag | loss parts] (trainer/step_verdict.py): every rank takes
     the same decision
  -> reduce gradients, clip, AdamW step (trainer/parallel/optimizer.py)
  -> heartbeat, metrics (rank 0), checkpoint / model checkpoint when due, preemption exit.
Under pipeline parallelism (parallel.pp > 1) the model is this rank's stage (trainer/pipeline/), the forward /
backward of the micro-batches is one `pipeline_step` (its schedule interleaves them across stages), and the
checkpoint files name the stage (trainer/checkpoint/layout.py); everything else (fault check, reduction, optimizer,
metrics) is the same code, run per stage.
Dtypes: compute in `train.dtype` (bf16 autocast on GPU by default); parameters and gradients in `train.param_dtype`
(bf16 with bf16 compute by default): the model is built and loaded in fp32, then its parameters are cast, and the
optimizer keeps the fp32 master weights and moments (and checkpoints them), so a resume stays bitwise.
Steps are 0-based inside (`step` = the batch index = the data position); records and checkpoints use the number of
COMPLETED steps (`done` = step + 1). The process group must exist before a Trainer is built (see __main__.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from dataclasses import asdict
from typing import Optional

import torch

from moe_launch import rundir
from moe_launch.conf.schema import RootConfig
from moe_launch.errors import ConfigError
from moe_launch.rundir import (
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_SOFT_FAULT,
    RunDir,
    journal_event,
    node_name,
)
from moe_launch.trainer import faults
from moe_launch.trainer.checkpoint import state as ckpt_state
from moe_launch.trainer.checkpoint.layout import Coords
from moe_launch.trainer.checkpoint.store import SlotChoice
from moe_launch.trainer.checkpointing import Checkpointing
from moe_launch.trainer.compile import compile_enabled, compile_model
from moe_launch.trainer.dist import Comm
from moe_launch.trainer.dtypes import cast_parameters, compute_dtype, param_dtype, set_determinism
from moe_launch.trainer.evaluate import HeldOut, eval_due
from moe_launch.trainer.heartbeat import HeartbeatWriter
from moe_launch.trainer.metrics import (
    MetricsSink,
    PerfRefs,
    load_summary,
    memory_gib,
    preflight_gemm_rate,
)
from moe_launch.trainer.model import build_model
from moe_launch.trainer.moe.balance import BiasBalancer, summed_counts
from moe_launch.trainer.moe.layer import MoELayer, check_precision, expert_weight_scope, warn_slow_expert_sizes
from moe_launch.trainer.moe.skew import (
    ChunkedExperts,
    expert_bytes_per_row,
    free_memory_bytes,
    install_skew_guard,
    load_alerts,
    newly_above,
    rows_budget,
    worst_case_rows,
)
from moe_launch.trainer.optim import clip_norm_at, lr_at, rewarmup_factor
from moe_launch.trainer.parallel.dispatch import attach_dispatchers
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import build_optimizer
from moe_launch.trainer.pipeline import Pipeline, build_pipeline, pipeline_step
from moe_launch.trainer.recompute import apply_recompute
from moe_launch.trainer.restore import Restore, UnverifiedResume
from moe_launch.trainer.spike import (
    RollbackState,
    Spike,
    SpikeDetector,
    batch_for_step,
    judge_spike,
    model_checkpoint_before,
    rollback_applies,
)
from moe_launch.trainer.start_phases import StartPhases
from moe_launch.trainer.step_stats import StepStats, start_copy
from moe_launch.trainer.step_verdict import agree
from moe_launch.trainer.tracking.flops import flops_per_token, step_peak
from moe_launch.trainer.tracking.steplog import LOGGER, install_rank_logging

log = logging.getLogger(LOGGER)


class Trainer(Restore, Checkpointing):
    def __init__(self, cfg: RootConfig, run_dir: RunDir, attempt: int = 0, device: torch.device = torch.device("cpu"),
                 model: Optional[torch.nn.Module] = None, verify_first: bool = False):
        """`model`: built, compiled and run once ahead of time by a warm standby (trainer/standby.py warm_model);
        else built here. `verify_first`: check the resume slot's digests before loading it, not while (restore.py)."""
        self.cfg, self.run_dir, self.attempt, self.device = cfg, run_dir.make(), attempt, device
        t, p = cfg.train, cfg.parallel
        self.groups = build_groups(p)
        self.comm = Comm(device)
        self.rank, self.host = self.groups.world_rank, node_name()
        self.hosts: list[str] = self.comm.all_gather_object(self.host)
        install_rank_logging(self.rank, self.host)
        self.coords = Coords.of(self.groups, p.optimizer_sharding, is_moe=cfg.model.kind == "moe")
        set_determinism(t.deterministic, device)
        self.dtype = compute_dtype(t.dtype, device)
        self.param_dtype = param_dtype(t.param_dtype, self.dtype)
        if cfg.model.kind == "moe":  # before any parameter is allocated
            check_precision(cfg.model.moe.precision, device)
            warn_slow_expert_sizes(cfg.model, device, self.dtype)
        per_pass = self.groups.data_size * t.micro_batch_size
        if t.global_batch_size % per_pass:
            raise ConfigError("train.global_batch_size", f"{t.global_batch_size} is not a multiple of data ranks "
                              f"({self.groups.data_size}) x train.micro_batch_size", f"use a multiple of {per_pass}")
        self.accum_steps = t.global_batch_size // per_pass  # under PP: the pipeline's micro-batches
        if p.pp > 1 and p.microbatches != self.accum_steps:
            raise ConfigError("parallel.microbatches", f"{p.microbatches}, but each pipeline runs {self.accum_steps} "
                              "micro-batches of train.micro_batch_size per step",
                              f"set parallel.microbatches={self.accum_steps}")
        self.injection = faults.active_injection(t.fault_injection, self.rank, attempt, self.host)
        self.compiled = compile_enabled(t.compile, device)
        self.prebuilt = model is not None
        self.phases = StartPhases(attempt, compiled=self.compiled)  # for the supervisor's recovery breakdown
        self.stop_requested = False
        self._prev_sync: Optional[float] = None  # perf_counter at the previous step's host sync (step timing)
        self._slept = 0.0  # train.step_sleep_s since then: not training time
        self._perf: Optional[PerfRefs] = None

        torch.manual_seed(t.seed)  # every stage / rank draws the same init: a stage gets its slice of the PP=1 model
        self.pipeline: Optional[Pipeline] = None
        if model is not None:
            self.model = model
        elif p.pp > 1:
            self.pipeline = build_pipeline(cfg.model, p, self.groups, device)  # attaches the EP token exchange too
            self.model = self.pipeline.model
        else:
            self.model = build_model(cfg.model, self.groups.ep_rank, self.groups.ep_size, device)
            attach_dispatchers(self.model, cfg, self.groups)  # EP token exchange; a no-op for ep=1
        if t.recompute and model is None:
            apply_recompute(self.model, t.recompute)
        self.weight_scope = expert_weight_scope(cfg.model, self.accum_steps, t.recompute)
        if self.compiled and model is None:  # the dense parts of every block (norms, attention), in place:
            # parameter names stay; the MoE layers stay eager. Tracing happens at the first forward, so in the
            # parameters' final dtype
            compile_model(self.model)
        self.loader = self._open_data()
        self.heldout = (HeldOut(cfg, self.groups.data_rank, self.groups.data_size, device) if t.eval_interval
                        else None)
        self.phases.mark("restore_start")
        self.resume = self._choose_resume(verify_first)
        try:  # loads from a slot whose digest check may still be running (restore.py)
            self._restore_state()
        except UnverifiedResume:
            raise
        except Exception:
            self._explain_load_error()  # a failed check is the cause: UnverifiedResume
            raise
        self._confirm_resume()
        self.ckpt = self._checkpoint_manager()
        self.phases.mark("restore_end")

    # -- setup ---------------------------------------------------------------------------------------------------
    def _restore_state(self) -> None:
        """Rollback state, weights, optimizer, RNG and data position from the chosen slot (or the fresh start)."""
        t, p, cfg = self.cfg.train, self.cfg.parallel, self.cfg
        self.rollback = self.comm.broadcast_object(RollbackState.read(self.run_dir.root) if self.rank == 0 else None)
        captured = ckpt_state.load_trainer_state(self.resume.path)["time"] if self.resume.path is not None else None
        if rollback_applies(self.rollback.pending, captured):
            self.resume = SlotChoice(path=None)  # a spike rollback outranks the full checkpoints written before it
        else:
            self.rollback.pending = None
        history = (self.rollback.pending or {}).get("history")  # a rollback judges against the pre-spike window
        self.spikes = SpikeDetector(t.spike, history) if t.spike.action is not None else None
        self.restart_step: Optional[int] = None  # set by a start from a model-only checkpoint (re-warm-up)
        self.resume_mode, self.saved_layout = "same", self._layout()  # _load_model sets the resumed slot's
        self.start_step = self._load_model()
        # after the weights are final (loads cast into the fp32-built model: any saved dtype works), before the
        # optimizer takes its fp32 masters from them; a resume then overwrites the masters with the saved exact ones
        cast_parameters(self.model, self.param_dtype)
        self.optimizer = build_optimizer(self.model, t, p, self.groups, t.lr)
        self.balancer = BiasBalancer.of(self.model, cfg.model.moe.bias_update_rate, self.groups.dp_ep)
        self.skew_guards = self._install_skew_guard()  # after the model and optimizer: sized by what is left
        self._skew_seen: dict = {"rows": 0, "above": set()}  # what the journal already says (records on change only)
        if self.resume.path is not None:
            self._load_optimizer_and_rng(self.resume.path)
            saved_state = ckpt_state.load_trainer_state(self.resume.path)
            self.loader.load_state_dict(saved_state["data"])
            if self.spikes is not None:  # a resumed run judges spikes against the history the original had
                self.spikes = SpikeDetector(t.spike, saved_state.get("spike_history"))

    def _open_data(self):
        from moe_launch.trainer.data import TokenLoader, resolve_dataset

        m, t, d = self.cfg.model, self.cfg.train, self.cfg.data
        if t.seq_len > m.max_seq_len:
            raise ConfigError("train.seq_len", f"{t.seq_len} is above model.max_seq_len={m.max_seq_len}",
                              "lower train.seq_len or raise model.max_seq_len")
        path = resolve_dataset(d, t.seq_len, m.vocab_size)
        return TokenLoader(path, d.format, t.seq_len, t.global_batch_size, self.groups.data_rank,
                           self.groups.data_size, t.seed, vocab_size=m.vocab_size)

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True

    # -- the loop ------------------------------------------------------------------------------------------------
    def train(self) -> int:
        t = self.cfg.train
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGUSR2, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._request_stop)
        sink = None
        if self.rank == 0:
            g, n_params = self.groups, sum(p.numel() for p in self.model.parameters())
            log.info(f"{g.world_size} ranks (dp={g.dp_size} ep={g.ep_size} pp={g.pp_size}), {n_params / 1e6:.1f}M "
                     f"parameters on rank 0, steps {self.start_step}..{t.steps}, {self.accum_steps} micro-batches per "
                     f"step, compute {self.dtype}, parameters {self.param_dtype}{self._expert_precision()}")
            sink = MetricsSink(self.run_dir, t.steps, self.start_step, t.tracking, t.progress, config=asdict(self.cfg))
        code: Optional[int] = None
        self.heartbeat = HeartbeatWriter(self.run_dir, self.rank, self.host)
        try:
            for step in range(self.start_step, t.steps):
                code = self._step(step, sink)
                if code is not None:
                    return self._finish_checkpoints(code)
            if t.ckpt_interval and self.ckpt.requested_step < t.steps:
                code = self._save_checkpoints(t.steps, full=True, model_only=False)
            return self._finish_checkpoints(EXIT_OK) if code is None else code
        except BaseException:
            # a crash of this rank: the in-flight checkpoint still completes (the writers of every rank meet on a
            # group of their own, which the training's blocked collectives do not hold up)
            self.ckpt.finish_quietly()
            raise
        finally:
            self.heartbeat.close()
            if sink is not None:
                sink.close()
            for sig, handler in previous.items():  # an embedding process (tests, notebooks) gets its handlers back
                signal.signal(sig, handler)

    def _expert_precision(self) -> str:
        if self.cfg.model.kind != "moe" or self.cfg.model.moe.precision != "fp8":
            return ""
        reuse = self.weight_scope is not contextlib.nullcontext
        return ", FP8 experts" + (" (each weight quantized once per step)" if reuse else "")

    def _forward_backward(self, step: int, done: int) -> tuple[torch.Tensor, list]:
        """Returns this rank's loss parts P = [loss, lm, aux, z] (means over micro-batches) and per-layer stats."""
        batch_BL = self.loader.get(batch_for_step(step, self.rollback.skips)).to(self.device, non_blocking=True)
        with self.weight_scope():  # the weights are fixed until the update: FP8 experts quantize them once
            return self._passes(batch_BL, done)

    def _passes(self, batch_BL: torch.Tensor, done: int) -> tuple[torch.Tensor, list]:
        if self.pipeline is not None:
            return self._pipeline_forward_backward(batch_BL, done)
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        per_layer: list = []
        for mb_BL in batch_BL.split(self.cfg.train.micro_batch_size):
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
                loss, parts = self.model.compute_loss(mb_BL[:, :-1], mb_BL[:, 1:])
            if self._injects("nan", done):
                loss = faults.poison_loss(loss)
            if self._injects("loss_spike", done):
                loss = faults.spike_loss(loss)
            (loss / self.accum_steps).backward()
            sums += torch.stack([loss.detach(), parts.lm_loss, parts.aux_loss, parts.z_loss]).double()
            per_layer.append(parts)
        if self._injects("inf_grad", done):
            faults.poison_grads(list(self.model.parameters()))
        return sums / self.accum_steps, per_layer

    def _pipeline_forward_backward(self, batch_BL: torch.Tensor, done: int) -> tuple[torch.Tensor, list]:
        """Every stage of a pipeline reads the same rows (same data rank); the step returns the whole pipeline's means
        (one small all-reduce over the stages), so each stage reports what the unpipelined model would."""
        loss, parts = pipeline_step(self.pipeline, list(batch_BL.split(self.cfg.train.micro_batch_size)),
                                    loss_scale=1.0 / self.accum_steps,
                                    autocast_dtype=None if self.dtype == torch.float32 else self.dtype)
        local_P = torch.stack([loss, parts.lm_loss, parts.aux_loss, parts.z_loss]).double()
        if self._injects("nan", done):
            # after the step: the loss is shared by the pipeline's stages, poisoning it inside would flag them all
            local_P[0] = float("nan")
        if self._injects("loss_spike", done):  # likewise after the step: the loss only, not the gradients
            local_P[0] = faults.spike_loss(local_P[0])
        if self._injects("inf_grad", done):
            faults.poison_grads(list(self.model.parameters()))
        return local_P, [parts]

    def _step(self, step: int, sink: Optional[MetricsSink]) -> Optional[int]:
        t, done = self.cfg.train, step + 1
        t0 = time.perf_counter()
        self._inject_before_step(done)
        local_P, per_layer = self._forward_backward(step, done)
        if self.phases.pending:
            self.phases.first_backward_done(self.run_dir, write=self.rank == 0)
        local_norm = self.optimizer.local_grad_norm()  # over the flat gradient buffers; reused as the global norm
        verdict = agree(self.comm, self.rank, self.groups.world_size, local_P, local_norm, self.stop_requested,
                        self.ckpt.persisting)
        dt = self._step_time(t0)
        if verdict.faulty:
            what = faults.local_fault(float(local_P[0]), float(local_norm)) if self.rank in verdict.faulty else None
            return self._fault(done, verdict.faulty, what)

        self.optimizer.reduce_grads()
        grad_norm = self.optimizer.clip_grad_norm_(clip_norm_at(step, t))
        if not math.isfinite(grad_norm):  # finite everywhere locally, non-finite reduced: report it from rank 0
            return self._fault(done, [0], f"non-finite global gradient norm {grad_norm} after reduction")
        lr = lr_at(step, t) * rewarmup_factor(step, self.restart_step, t.rewarmup_steps)
        spike = self._check_spike(done, float(verdict.mean_P[0]), grad_norm)
        if spike is not None and t.spike.action != "skip":
            return self._spike_exit(spike)
        logs = done % t.log_interval == 0 or done == t.steps
        # every rank on log steps (the expert counts are all-reduced); queued ahead of the update, so reading them
        # back waits for the copy only and the logging overlaps the update (trainer/step_stats.py)
        pending = start_copy(verdict.mean_P, per_layer, self._global_counts(per_layer)) if logs else None
        self.ckpt.fence()  # the snapshot of the last checkpoint is read from these tensors until here
        if spike is None:  # a skipped spike drops the update; the data position and the schedule move on
            self.optimizer.step(lr)
        self.optimizer.zero_grad()
        if self.balancer is not None and spike is None:
            self.balancer.update(self._stage_loads(per_layer))

        self.heartbeat.beat(done)
        if self._reserve_after_first_step is not None:
            self._reserve_after_first_step()
            self._reserve_after_first_step = None
        if pending is not None:
            stats = pending.get()
            self._skew_records(done, stats.counts_LE)
            if sink is not None:
                sink.log(self._record(done, stats, grad_norm, lr, dt))
        self._test_sleep()
        stop = verdict.stop and done < t.steps  # a warning during the final step: the normal end takes over
        if eval_due(done, t.eval_interval, t.steps) and not stop:  # a stop's checkpoint cannot wait for it
            self._slept += self.heldout.evaluate(done, self.model, self.dtype, self.comm.all_reduce_,
                                                 self.weight_scope, self.heartbeat, sink)  # not training time
        full = bool(t.ckpt_interval and done % t.ckpt_interval == 0) or stop  # preemption always leaves one
        if full and not stop and verdict.persisting and t.ckpt_when_busy == "skip":
            full = self._skip_checkpoint(done)
        model_only = bool(t.model_ckpt_interval and done % t.model_ckpt_interval == 0)
        if full or model_only:
            code = self._save_checkpoints(done, full, model_only)
            if code is not None:
                return code
        if stop:
            code = self._finish_checkpoints(EXIT_PREEMPTED)  # the preemption checkpoint must be durable first
            if self.rank == 0:
                journal_event(self.run_dir, "stop", self.hosts, reason="signal", step=done,
                              checkpoint=self.ckpt.newest_slot)
            return code
        return None

    def _check_spike(self, done: int, loss: float, grad_norm: float) -> Optional[Spike]:
        """Judged on global values only, so every rank reaches the same verdict; a skip leaves a journal record."""
        spike = self.spikes.observe(done, loss, grad_norm) if self.spikes is not None else None
        if spike is not None and self.cfg.train.spike.action == "skip" and self.rank == 0:
            journal_event(self.run_dir, "spike", [], step=done, metric=spike.metric, value=spike.value,
                          median=spike.median, limit=spike.limit, action="skip", what=spike.describe())
        return spike

    def _spike_exit(self, spike: Spike) -> int:
        """rollback: rank 0 records where the relaunched trainer restarts and which batches it never reads again,
        then every rank exits with EXIT_ROLLBACK; stop, a recurrence, or nothing to roll back to: EXIT_SPIKE."""
        t = self.cfg.train
        self.ckpt.finish()  # a model checkpoint still being written may be the one to roll back to
        verdict = None
        if self.rank == 0:  # one reading of the checkpoint directory decides for every rank
            before = model_checkpoint_before(self.run_dir.checkpoints, spike.step) if t.spike.action == "rollback" \
                else None
            verdict = judge_spike(spike, t.spike, self.rollback, self.start_step,
                                  batch_for_step(spike.step - 1, self.rollback.skips), before)
            if verdict.plan is not None:
                state = self.rollback.with_rollback(verdict.plan, spike.step, time.time(), self.spikes.state_dict())
                state.write(self.run_dir.root)
            plan = verdict.plan
            journal_event(self.run_dir, "spike", [], step=spike.step, metric=spike.metric, value=spike.value,
                          median=spike.median, limit=spike.limit, action=verdict.action, what=verdict.why,
                          rollback_to=plan.checkpoint if plan else None, restart_step=plan.step if plan else None,
                          skip_batches=list(plan.skip) if plan else None)
            print(f"[trainer] spike: {verdict.why} -> {verdict.action}", flush=True)
        verdict = self.comm.broadcast_object(verdict)
        return rundir.EXIT_ROLLBACK if verdict.plan is not None else rundir.EXIT_SPIKE

    def _install_skew_guard(self) -> list[ChunkedExperts]:
        """Worst-case expert rows of a micro-batch against the memory left under train.max_memory_fraction; chunk
        the expert stage of every MoE layer when the worst case does not fit (trainer/moe/skew.py)."""
        m, t = self.cfg.model, self.cfg.train
        layers = [mod for mod in self.model.modules() if isinstance(mod, MoELayer)]
        if not layers:
            return []
        worst = worst_case_rows(t.micro_batch_size * t.seq_len, m.moe.top_k, self.groups.ep_size, m.moe.dispatcher)
        row_bytes = expert_bytes_per_row(m.d_model, m.moe.expert_hidden, self.dtype.itemsize, len(layers))
        budget = rows_budget(free_memory_bytes(self.device, t.max_memory_fraction), row_bytes)
        if self.rank == 0:
            journal_event(self.run_dir, "skew", [], worst_case_rows=worst, row_bytes=row_bytes,
                          worst_case_bytes=worst * row_bytes, rows_budget=budget,
                          chunked=worst > budget, max_memory_fraction=t.max_memory_fraction)
        return install_skew_guard(layers, budget) if worst > budget else []

    def _skew_records(self, done: int, counts_LE: Optional[torch.Tensor]) -> None:
        """Journal the guard's chunked expert calls when they reach a new size (any rank) and, from rank 0, the layers
        whose global max/mean expert load rose above train.expert_load_alert since the last log step."""
        chunked = [e for g in self.skew_guards for e in g.drain()]
        rows = max((r for r, _ in chunked), default=0)
        if rows > self._skew_seen["rows"]:
            self._skew_seen["rows"] = rows
            journal_event(self.run_dir, "skew", [self.host], step=done, rank=self.rank, chunked_calls=len(chunked),
                          max_rows=rows, max_chunks=max(c for _, c in chunked))
        alerts = load_alerts(counts_LE, self.cfg.train.expert_load_alert) if counts_LE is not None else []
        new, self._skew_seen["above"] = newly_above(alerts, self._skew_seen["above"])
        if new and self.rank == 0:
            journal_event(self.run_dir, "skew", [], step=done, alert="expert load max/mean above "
                          f"train.expert_load_alert={self.cfg.train.expert_load_alert}",
                          layers={str(i): round(r, 3) for i, r in new})

    def _stage_loads(self, per_layer: list) -> list[torch.Tensor]:
        """This step's expert load of each MoE layer held here (a pipeline reports every layer of the model)."""
        loads = summed_counts(per_layer, len(per_layer[0].counts_per_layer))
        if self.pipeline is not None:
            loads = [loads[i] for c in self.pipeline.model.chunks for i in self.pipeline.chunk_ranges[c]]
        return loads

    def _injects(self, kind: str, done: int) -> bool:
        """Test hook: train.fault_injection strikes with `kind` on this rank at this step."""
        return self.injection == kind and done == self.cfg.train.fault_injection.step

    def _inject_before_step(self, done: int) -> None:
        """Test hook: the process faults (hang, crash, sigkill) strike before the step's work."""
        if self.injection in ("hang", "crash", "sigkill") and self._injects(self.injection, done):
            {"hang": faults.hang_forever, "sigkill": faults.sigkill_self}.get(self.injection, self._crash)()

    def _step_time(self, t0: float) -> float:
        """Seconds of this step, host sync to host sync: the device work queued after a sync (the previous step's
        update) ends before the next sync, so the intervals add up to the wall clock; train.step_sleep_s excluded."""
        t_sync = time.perf_counter()
        dt = t_sync - (self._prev_sync if self._prev_sync is not None else t0) - self._slept
        self._prev_sync, self._slept = t_sync, 0.0
        return dt

    def _test_sleep(self) -> None:
        """train.step_sleep_s: slows the steps so tests can strike mid-run; not counted as step time."""
        if self.cfg.train.step_sleep_s:
            time.sleep(self.cfg.train.step_sleep_s)
            self._slept = self.cfg.train.step_sleep_s

    def _crash(self) -> None:
        raise faults.InjectedCrash(f"injected crash on rank {self.rank} at step {self.cfg.train.fault_injection.step}")

    def _global_counts(self, per_layer: list) -> Optional[torch.Tensor]:
        """[L, E] expert counts of this stage's MoE layers over every data rank's micro-batches of the step (one
        small all-reduce on log steps only). None for a dense model."""
        n_layers = len(per_layer[0].counts_per_layer)
        if n_layers == 0:
            return None
        counts_LE = torch.stack(summed_counts(per_layer, n_layers))
        if self.groups.data_size > 1:  # a size-1 group has no handle, and None would mean the world
            Comm(self.device, self.groups.dp_ep_group).all_reduce_(counts_LE)
        return counts_LE

    def _perf_refs(self) -> PerfRefs:
        """Built on the first logged step: the preflight ran before the launch, the device name needs CUDA up."""
        if self._perf is None:
            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
            self._perf = PerfRefs(flops_per_token(self.cfg.model, self.cfg.train.seq_len), self.groups.world_size,
                                  step_peak(self.cfg.model, self.cfg.train.seq_len, name, self.cfg.train.peak_flops),
                                  preflight_gemm_rate(self.run_dir, self.hosts))
        return self._perf

    def _record(self, done: int, stats: StepStats, grad_norm: float, lr: float, dt: float) -> dict:
        t = self.cfg.train
        loss, lm, aux, z = stats.mean_P
        load_max, load_mean = load_summary(list(stats.counts_LE) if stats.counts_LE is not None else [])
        tokens_per_s = t.global_batch_size * t.seq_len / dt
        mfu, mfu_gemm = self._perf_refs().mfu(tokens_per_s)
        return {
            "step": done, "loss": loss, "lm_loss": lm, "aux_loss": aux, "z_loss": z, "grad_norm": grad_norm,
            "lr": lr, "tokens_per_s": tokens_per_s, "step_time_s": dt, "mfu": mfu, "mfu_gemm": mfu_gemm,
            "expert_load_max": load_max, "expert_load_mean": load_mean, "mem_gib": memory_gib(self.device),
            "time": time.time(), "aux_per_layer": stats.aux_L, "z_per_layer": stats.z_L,
            "expert_counts": stats.counts_LE.tolist() if stats.counts_LE is not None else None,
        }

    def _fault(self, done: int, faulty: list[int], what: Optional[str]) -> int:
        """Every rank returns EXIT_SOFT_FAULT; the faulty ones leave a record; nothing of this step is saved."""
        if self.rank in faulty:
            faults.write_fault_record(self.run_dir, self.host, self.rank, done, what or "non-finite values",
                                      attempt=self.attempt)
        if self.rank == 0:
            journal_event(self.run_dir, "fault", sorted({self.hosts[r] for r in faulty}), step=done,
                          ranks=faulty, what=what if self.rank in faulty else "non-finite values on other ranks")
        return EXIT_SOFT_FAULT

    # -- checkpoints ---------------------------------------------------------------------------------------------
