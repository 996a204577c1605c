"""`python -m moe_launch.trainer --run-dir RUN_DIR [--attempt K] [--standby]`, one process per rank (torchrun or srun).

A launched rank first looks for a warm standby of its node and local rank and hands over to it if one is ready
(trainer/standby.py); `--standby` starts such a process.

Exit codes (moe_launch.rundir): 0 done, 2 bad config or data, 3 NaN/Inf on a rank (fault record written),
4 preempted by SIGUSR2/SIGTERM after a clean checkpoint, 5 unusable checkpoint, 6 / 7 spike (rollback / none
possible), 8 checkpoints kept failing to persist (storage); anything else is a crash.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from moe_launch.errors import CheckpointError, ConfigError, DataError
from moe_launch.rundir import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_OK, RunDir


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_launch.trainer", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, type=Path, help="run directory holding config.yaml")
    ap.add_argument("--attempt", type=int, default=0, help="launch attempt (fault injection fires on its attempt only)")
    ap.add_argument("--standby", action="store_true",
                    help="start warm and wait until a launched rank hands over to this process (supervisor.standby)")
    args = ap.parse_args(argv)

    from moe_launch.trainer.standby import hand_over, serve  # no torch: the hand-over must not wait for imports

    if not args.standby:
        code = hand_over(args.run_dir, args.attempt)
        if code is not None:
            return code

    from omegaconf.errors import OmegaConfBaseException

    from moe_launch.conf.load import load_config

    try:
        cfg = load_config(args.run_dir / "config.yaml")
    except (ConfigError, OSError, OmegaConfBaseException) as e:
        print(f"[trainer] bad config {args.run_dir / 'config.yaml'}: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    if "OMP_NUM_THREADS" not in os.environ and os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        # srun --cpus-per-task gives the task that many CPUs; torch would otherwise start one thread per core of
        # the node and the node's ranks would oversubscribe it
        import torch

        torch.set_num_threads(max(1, int(os.environ["SLURM_CPUS_PER_TASK"])))
    if cfg.train.deterministic:  # cuBLAS reads this when CUDA starts; it must precede any CUDA call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # NCCL picks ring or tree per message size and topology, and the two sum in different orders: one algorithm
        # for every size keeps an all-reduce's bits a function of the inputs (for a fixed GPU count and topology)
        os.environ.setdefault("NCCL_ALGO", "Ring")
    from moe_launch.trainer.compile import compile_cache_env

    for key, value in compile_cache_env(args.run_dir.absolute()).items():
        os.environ.setdefault(key, value)
    if args.standby:
        return serve(cfg, RunDir(args.run_dir), run_trainer)
    return run_trainer(cfg, RunDir(args.run_dir), args.attempt)


def run_trainer(cfg: Any, run_dir: RunDir, attempt: int, model: Any = None) -> int:
    """Join the process group of this rank's environment and train; the exit code. `model`: a warm standby's."""
    from moe_launch.trainer.dist import collective_timeout_s, detect_env, init_distributed, pick_device, settle

    code = EXIT_CONFIG
    try:
        env = detect_env(os.environ)
        device = pick_device(env)
        init_distributed(env, device, timeout_s=collective_timeout_s(cfg.supervisor.hang_timeout_s))
        code = build_trainer(cfg, run_dir, attempt, device, model).train()
    except (ConfigError, DataError) as e:
        print(f"[trainer] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = EXIT_CONFIG
    except CheckpointError as e:
        print(f"[trainer] CheckpointError: {e}", file=sys.stderr, flush=True)
        code = EXIT_CHECKPOINT
    if code == EXIT_OK:
        settle()  # on failure paths peers may be gone: leave without a collective
    return code


def build_trainer(cfg: Any, run_dir: RunDir, attempt: int, device: Any, model: Any = None) -> Any:
    """The Trainer, restored from the newest slot that passes its digest check. The check runs while the slot loads;
    when it fails (every rank raises at the same point), what was loaded is dropped and the trainer is built again,
    checking the slots before loading."""
    from moe_launch.trainer.loop import Trainer
    from moe_launch.trainer.restore import UnverifiedResume

    try:
        return Trainer(cfg, run_dir, attempt=attempt, device=device, model=model)
    except UnverifiedResume:
        pass
    gc.collect()  # the first build's model and optimizer, before the second allocates its own
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    return Trainer(cfg, run_dir, attempt=attempt, device=device, model=model, verify_first=True)


def leave(code: int) -> None:
    """End the process with `code` once its output is flushed, without running destructors: the process groups'
    C++ teardown at interpreter exit (gloo and store threads, groups destroyed in whatever order) can abort a
    process that has finished cleanly, which the supervisor would read as a failed node. Files are closed by then
    (journal and metrics are written line by line, the tracking backends closed by the trainer)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def exit_code_of(run: Any) -> int:
    """`run()`'s exit code, with what an uncaught exception would have done to the process (its traceback through
    sys.excepthook, code 1), so that `leave` ends a crashed rank too: a crash must exit 1, never abort in teardown."""
    try:
        return run()
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


if __name__ == "__main__":
    leave(exit_code_of(main))
