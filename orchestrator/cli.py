"""`moe-launch`: the login-side entry point.

    moe-launch [hydra overrides]            plan, submit one allocation of N+B nodes, follow the run live
    moe-launch dry_run=true [overrides]     (or --dry-run) print the plan and the job script, submit nothing
    moe-launch attach runs/<name>           follow a run again (after the login session died); resubmits as needed
    moe-launch status runs/<name>           one-shot view of a run
    moe-launch stop runs/<name>             ask the supervisor to checkpoint and stop
    moe-launch report runs/<name> [more]    plots of one run, or several overlaid (orchestrator/report.py)
    moe-launch export runs/<name> --hf DIR  newest valid checkpoint -> transformers directory (trainer/interop/)
    moe-launch import HF_DIR --out DIR      transformers directory -> model-only checkpoint
    moe-launch -m model=tiny_dense,tiny_moe train.lr=1e-3,3e-4
                                            a sweep: one supervised run per combination, then a summary table,
                                            <sweep dir>/sweep_summary.json and plots (orchestrator/sweep.py)

The subcommands are handled before Hydra sees argv (their parsers and `--help`: commands.py). The run directory is
Hydra's output directory, `${run.root}/${run.name}` unless `hydra.run.dir=...` moves it; a sweep's is
`${run.root}/${run.name}` with one directory `${run.name}-<job number>` per run (a unique run name per job).
Exit codes: 0 completed (or dry run), 1 the run failed or stopped, 2 bad configuration (ours, or Hydra's: an unknown
key, a value of the wrong type) or submission refused.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Optional

from moe_launch.errors import CheckpointError, ConfigError, DataError, SubmissionError
from moe_launch.orchestrator.commands import OVERVIEW, SUBCOMMANDS, parser

_DEFAULT_OVERRIDES = {
    "hydra.run.dir": "${run.root}/${run.name}",
    "hydra.sweep.dir": "${run.root}/multirun-${now:%Y-%m-%d_%H-%M-%S}",
    "hydra.sweep.subdir": "${hydra.job.num}",
    "hydra.job.name": "moe-launch",
    # job logging to stdout only: the login side prints what it does, a run-dir moe-launch.log stayed empty
    "hydra/job_logging": "stdout",
}
_MULTIRUN_OVERRIDES = {  # a sweep's runs: each its own run directory (and run name, hence Slurm job name)
    "hydra.sweep.dir": "${run.root}/${run.name}",
    "hydra.sweep.subdir": "${run.name}-${hydra.job.num}",
    "++hydra.callbacks.moe_launch_sweep._target_": "moe_launch.orchestrator.sweep.SweepCallback",
}


def _fail(message: str, code: int = 2) -> int:
    print(f"moe-launch: {message}", file=sys.stderr)
    return code


def _load_run(path: str):
    from moe_launch.conf.load import load_config
    from moe_launch.rundir import RunDir

    rd = RunDir(Path(path).absolute())
    if not rd.config.exists():
        raise SubmissionError(f"{rd.root} is not a run directory (no config.yaml); pass runs/<name>")
    return load_config(rd.config), rd


def subcommand(argv: list[str]) -> int:
    try:
        args = parser(argv[0]).parse_args(argv[1:])
    except SystemExit as e:  # --help (0) or a usage error (argparse's 2, our bad-input code too)
        return int(e.code or 0)
    if argv[0] in ("report", "export"):
        if not (args.run / "config.yaml").exists() and not (args.run / "metrics.jsonl").exists() and not (
                argv[0] == "report" and any(args.run.glob("*/config.yaml"))):
            return _fail(f"no such run: {args.run} (no config.yaml or metrics.jsonl there); pass runs/<name>")
    try:
        if argv[0] == "report":
            from moe_launch.orchestrator.report import main_report

            return main_report(args.run, args.compare, out_dir=args.out)
        if argv[0] in ("export", "import"):
            from moe_launch.trainer.interop.run_export import export_run, import_hf

            out = (export_run(args.run, args.hf, args.checkpoint, args.dtype) if argv[0] == "export"
                   else import_hf(args.hf, args.out, args.ep))
            print(f"wrote {out}")
            return 0
    except (ConfigError, SubmissionError, CheckpointError, DataError) as e:
        return _fail(str(e))
    from moe_launch.orchestrator import live, login

    try:
        cfg, rd = _load_run(str(args.run))
        if argv[0] == "attach":
            from moe_launch.rundir import journal_event

            journal_event(rd, "attach", ())
            return login.follow(cfg, rd)
        if argv[0] == "stop":
            print(login.request_stop(cfg, rd))
            return 0
        snap = live.snapshot(rd, cfg.cluster.nodes, cfg.supervisor.max_restarts, cfg.train.steps)
        from rich.console import Console

        Console().print(live.render(snap))
        if snap.summary:
            print(json.dumps(snap.summary, indent=2, sort_keys=True))
        return 0
    except (ConfigError, SubmissionError) as e:
        return _fail(str(e))


def _discard_if_empty(run_dir: Path) -> None:
    """A dry run or a refused config leaves no run behind: drop the directory if it holds only Hydra's own files."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "moe-launch.log"}:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_app(cfg_node) -> int:
    """The Hydra task: convert (validates), plan, then dry-run or submit and follow."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir).absolute()
    sweep = hc.mode == RunMode.MULTIRUN
    code = 2
    try:
        code = _run_app(cfg_node, run_dir, sweep, list(hc.overrides.task), Path(hc.runtime.cwd))
        return code
    finally:
        _discard_if_empty(run_dir)
        if sweep:
            from moe_launch.orchestrator.sweep import record_job

            record_job(run_dir, list(hc.overrides.task), code)


def _run_app(cfg_node, run_dir: Path, sweep: bool, overrides: list[str], launch_dir: Path) -> int:
    from omegaconf import OmegaConf

    from moe_launch.conf.keys import unknown_keys
    from moe_launch.conf.schema import all_problems
    from moe_launch.orchestrator import local_gpus, login
    from moe_launch.orchestrator.render import render_sbatch
    from moe_launch.orchestrator.start import earlier_exclusions, start_run
    from moe_launch.rundir import RunDir
    from moe_launch.trainer.data.check import check_data

    unknown = unknown_keys(cfg_node)
    if unknown:  # `+group.key=value` adds keys the dataclasses would silently drop
        return _fail("bad configuration: " + "; ".join(
            f"{key}: not a setting of moe-launch. Fix: check the spelling; known here: {', '.join(known)}"
            for key, known in unknown))
    try:
        with all_problems():  # every bad value in one message, not one per try
            cfg = OmegaConf.to_object(cfg_node)
        if cfg.cluster.kind == "local":
            cfg, note = local_gpus.fit_layout(cfg, len(local_gpus.visible_gpus()),
                                              local_gpus.layout_overridden(overrides))
            if note:
                print(f"moe-launch: {note}", file=sys.stderr)
    except ConfigError as e:
        return _fail(f"bad configuration: {e}")
    try:  # the trainer would refuse bad data only after the allocation: check the headers now
        t = cfg.train
        cfg.data = check_data(cfg.data, t.seq_len, cfg.model.vocab_size, launch_dir,
                              t.eval_batches * t.global_batch_size if t.eval_interval else 0)
    except DataError as e:
        return _fail(f"refused before submission: {e}")
    cfg.run.name = run_dir.name  # the directory is the run's name (multirun jobs get numbered directories)
    carried = earlier_exclusions(cfg, RunDir(run_dir)) if cfg.cluster.kind == "slurm" else {}
    if carried:
        print("moe-launch: excluding node(s) that failed in earlier starts of this run: " +
              "; ".join(f"{n} ({why})" for n, why in carried.items()), file=sys.stderr)
    try:
        p = login.make_plan(cfg, run_dir, tuple(carried))
    except (ConfigError, SubmissionError) as e:
        return _fail(f"refused before submission: {e}")
    for w in p.warnings:
        print(f"moe-launch: warning: {w}", file=sys.stderr)
    if cfg.dry_run:
        print("# launch plan\n" + json.dumps(p.to_json(), indent=2))
        if p.kind == "slurm":
            print("# job script\n" + render_sbatch(p))
        else:
            print(f"# cluster.kind=local: the supervisor runs here as: {' '.join(p.supervisor_argv)}")
        return 0
    if cfg.render_sbatch is not None:
        return _render_for_hand_submission(cfg, run_dir, p)
    rd = RunDir(run_dir).make()
    try:
        handle = start_run(cfg, rd, p)
    except SubmissionError as e:
        return _fail(f"not started: {e}")
    print(f"moe-launch: run {cfg.run.name} started ({p.kind}: {handle}); outputs in {rd.root}", file=sys.stderr)
    if sweep and p.kind == "slurm":  # submit every allocation first; SweepCallback follows them all together
        return 0
    return login.follow(cfg, rd)


def _render_for_hand_submission(cfg, run_dir: Path, p) -> int:
    """Writes the run directory's config.yaml (the supervisor and the checks read it) and the job script, prints
    the script's path and `sbatch` command. Nothing is submitted."""
    from moe_launch.conf.load import dump_config
    from moe_launch.orchestrator.plan import write_plan
    from moe_launch.orchestrator.render import render_preflight_sbatch, render_sbatch
    from moe_launch.rundir import RunDir

    if p.kind != "slurm":
        return _fail("render_sbatch: needs cluster=slurm (cluster.kind=local runs no job script)")
    rd = RunDir(run_dir).make()
    dump_config(cfg, rd.config)
    write_plan(p, rd.root)
    name, text = (("job.sbatch", render_sbatch(p)) if cfg.render_sbatch == "run"
                  else ("preflight.sbatch", render_preflight_sbatch(p)))
    script = rd.root / "sbatch" / name
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    print(text)
    print(f"# written to {script}; submit with: sbatch {script}", file=sys.stderr)
    return 0


def _check_run_names(argv: list[str]) -> None:
    from moe_launch.conf.schema import check_run_name

    for a in argv:
        key, sep, value = a.lstrip("+~").partition("=")
        if sep and key == "run.name":
            for name in value.split(",") if any(m in argv for m in ("-m", "--multirun")) else [value]:
                check_run_name(name.strip().strip("'\""))


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        sys.exit(subcommand(argv))
    if any(a in ("-h", "--help") for a in argv):  # ours first; Hydra then lists the config groups and exits 0
        print(OVERVIEW)
        argv = [a for a in argv if a != "-h"] + ([] if "--help" in argv else ["--help"])
    flags = {"--dry-run": "dry_run=true", "--render-sbatch": "render_sbatch=run",
             "--render-preflight": "render_sbatch=preflight"}
    argv = [flags.get(a, a) for a in argv]
    try:  # Hydra creates the run directory from run.name before any check of ours: "a/b" or ".." must not get there
        _check_run_names(argv)
    except ConfigError as e:
        sys.exit(_fail(f"bad configuration: {e}"))
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if multirun:  # Hydra's parser wants its flags before the overrides (`--dry-run -m ...` puts one in front)
        argv = ["--multirun", *(a for a in argv if a not in ("-m", "--multirun"))]
    defaults = {**_DEFAULT_OVERRIDES, **_MULTIRUN_OVERRIDES} if multirun else _DEFAULT_OVERRIDES
    for key, value in defaults.items():
        if not any(a.lstrip("+").startswith(key.lstrip("+") + "=") for a in argv):
            argv.append(f"{key}={value}")
    import hydra

    from moe_launch.conf.store import register

    register()
    codes: list[int] = []

    @hydra.main(config_path=None, config_name="moe_launch", version_base=None)
    def _app(cfg_node) -> int:
        code = run_app(cfg_node)
        codes.append(code)
        return code

    sys.argv = [sys.argv[0], *argv]
    try:
        _app()
    except SystemExit as e:
        # Hydra exits 1 on an override it cannot parse or apply (unknown key, bad type, missing group option);
        # that is a bad configuration: exit 2, the code our own config checks use
        if e.code == 1 and not codes:
            sys.exit(2)
        raise
    if multirun:
        from moe_launch.orchestrator.sweep import RESULT

        codes.append(RESULT.pop("code", 0))
    sys.exit(max(codes, default=0))


if __name__ == "__main__":
    main()
