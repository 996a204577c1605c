"""The `moe-launch` subcommands' argument parsers and the top-level help; cli.py dispatches.

Hydra owns `moe-launch [overrides]` (and prints the config groups under `--help`); everything that acts on an
existing run directory is a subcommand parsed here with argparse, so `moe-launch <sub> --help` works and exits 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

OVERVIEW = """\
usage: moe-launch [--dry-run] [--render-sbatch | --render-preflight] [-m] [key=value ...]
       moe-launch <subcommand> RUN_DIR [options]

Pretrain a Mixture-of-Experts model on Slurm (or local processes): plan, preflight, launch, supervise, resume.

subcommands (moe-launch <subcommand> --help for each):
  attach  RUN_DIR               follow a run again (after the login session died); resubmits as needed
  status  RUN_DIR               one-shot view of a run
  stop    RUN_DIR               ask the supervisor to checkpoint and stop
  report  RUN_DIR [RUN_DIR...]  plots of a run (report.html + PNGs), several runs overlaid
  export  RUN_DIR --hf DIR      newest valid checkpoint -> a transformers directory (config, weights, tokenizer)
  import  HF_DIR --out DIR      a transformers OLMoE directory -> a checkpoint; train with model.init_from=ckpt:DIR

other commands:
  moe-health   node health: preflight, baselines, history report, quarantine release
  moe-data     prepare token datasets from your own text (moe-data prepare --input 'docs/*.txt' ...)

flags:
  --dry-run            print the launch plan and job script, submit nothing
  --render-sbatch      write the job script for hand submission (cluster=slurm)
  --render-preflight   write the preflight job script (cluster=slurm)
  -m, --multirun       a sweep: one supervised run per combination of comma-separated values

exit codes: 0 completed (or dry run), 1 the run failed or stopped, 2 bad configuration or refused submission
"""

SUBCOMMANDS = ("attach", "status", "stop", "report", "export", "import")


def parser(name: str) -> argparse.ArgumentParser:
    """The argparse parser of one subcommand."""
    prog = f"moe-launch {name}"
    if name in ("attach", "status", "stop"):
        what = {"attach": "follow a run again; resubmits allocations as needed",
                "status": "one-shot view of a run: nodes, restarts, step, summary",
                "stop": "ask the run's supervisor to checkpoint and stop"}[name]
        ap = argparse.ArgumentParser(prog=prog, description=what)
        ap.add_argument("run", type=Path, help="the run directory, runs/<name>")
        return ap
    if name == "report":
        ap = argparse.ArgumentParser(prog=prog, description="plots of a run: loss parts, lr, grad norm, tokens/s, "
                                     "MFU, step time, expert-load heatmap, failures and restarts on the time axis; "
                                     "writes RUN_DIR/plots/report.html and PNGs")
        ap.add_argument("run", type=Path, help="the run directory, runs/<name> (a sweep directory: all its runs)")
        ap.add_argument("compare", type=Path, nargs="*", help="more run directories to overlay")
        ap.add_argument("--out", type=Path, default=None, help="output directory (default: RUN_DIR/plots)")
        return ap
    if name == "export":
        ap = argparse.ArgumentParser(prog=prog, description="write the run's newest valid checkpoint as a "
                                     "transformers directory (OlmoeForCausalLM: config.json, model.safetensors, "
                                     "tokenizer.json, generation_config.json)")
        ap.add_argument("run", type=Path, help="the run directory, runs/<name>")
        ap.add_argument("--hf", type=Path, required=True, help="output directory")
        ap.add_argument("--checkpoint", default=None, help="a checkpoint name under RUN_DIR/checkpoints "
                        "(default: the newest valid one)")
        ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="cast the weights on write (default: as stored)")
        return ap
    if name == "import":
        ap = argparse.ArgumentParser(prog=prog, description="convert a transformers OLMoE/OLMo-style directory "
                                     "into a model-only checkpoint; train from it with model.init_from=ckpt:OUT")
        ap.add_argument("hf", type=Path, help="a save_pretrained directory (config.json + safetensors)")
        ap.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
        ap.add_argument("--ep", type=int, default=1, help="parallel.ep of the run that will load it")
        return ap
    raise KeyError(name)
