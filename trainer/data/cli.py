"""`moe-data`: prepare token datasets and look inside them.

    moe-data prepare --input DIR_OR_GLOB [--input ...] --output OUT [--tokenizer builtin|tokenizer.json]
                     [--seq-len L] [--shard-size N] [--workers W] [--cluster local|slurm] [--seed S]
    moe-data prepare --builtin [--output OUT]     the built-in corpus (Python's standard library sources)
    moe-data inspect PATH [--format npy|megatron] [--seq-len L] [--show K]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_launch.errors import MoeLaunchError
from moe_launch.rundir import EXIT_CONFIG


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-data", description="Token datasets for moe-launch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text into shuffled .npy shards + index.json")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", action="append", help='directory (recursive) or glob; .jsonl needs a "text" field')
    src.add_argument("--builtin", action="store_true", help="the built-in corpus (Python standard library sources)")
    p.add_argument("--output", help="output directory (default for --builtin: the data.cache_dir entry)")
    p.add_argument("--tokenizer", default="builtin", help="builtin or a HF tokenizer.json (default: builtin)")
    p.add_argument("--vocab-size", type=int, default=4096, help="size of the built-in BPE (default 4096)")
    p.add_argument("--eos", default=None, help="end-of-document token text (default: guessed from the tokenizer)")
    p.add_argument("--seq-len", type=int, default=128, help="context length L; instances hold L+1 tokens")
    p.add_argument("--shard-size", type=int, default=4096, help="instances per shard file")
    p.add_argument("--workers", type=int, default=2, help="parallel tokenization processes / Slurm array tasks")
    p.add_argument("--parts", type=int, default=0, help="number of tokenization parts (default: 4 x workers)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle across all files")
    p.add_argument("--cluster", choices=("local", "slurm"), default="local")
    p.add_argument("--partition", default=None, help="Slurm partition (with --cluster slurm)")
    p.add_argument("--time-min", type=int, default=60, help="Slurm time limit per task, minutes")
    p.add_argument("--cache-dir", default="~/.cache/moe-launch/data", help="where the built-in tokenizer is cached")
    p.add_argument("--no-progress", action="store_true")
    i = sub.add_parser("inspect", help="print a dataset's index and decode a few instances")
    i.add_argument("path")
    i.add_argument("--format", choices=("npy", "megatron"), default="npy")
    i.add_argument("--seq-len", type=int, default=None, help="required for megatron; default: the index's")
    i.add_argument("--tokenizer", default=None, help="tokenizer.json to decode with (default: the dataset's own)")
    i.add_argument("--show", type=int, default=1, help="instances to decode")
    return parser


def _prepare(args: argparse.Namespace) -> dict:
    from moe_launch.conf.schema import DataConfig
    from moe_launch.trainer.data.builtin import build_builtin, prepare_builtin
    from moe_launch.trainer.data.prepare import PrepareSpec, prepare
    from moe_launch.trainer.data.shards import read_index

    progress = not args.no_progress
    if args.builtin and args.output is None:
        # the very entry resolve_dataset uses (same key, same lock), so a trainer finds it prepared
        cfg = DataConfig(tokenizer=args.tokenizer, cache_dir=args.cache_dir, shard_size=args.shard_size,
                         workers=args.workers, seed=args.seed)
        path, summary = build_builtin(cfg, args.seq_len, args.vocab_size, cluster=args.cluster, progress=progress)
        if summary is None:
            summary = {"output": str(path), "instances": read_index(path).total_instances, "already_prepared": True}
        return summary
    if args.builtin:
        return prepare_builtin(
            args.output, seq_len=args.seq_len, vocab_size=args.vocab_size, seed=args.seed, tokenizer=args.tokenizer,
            shard_size=args.shard_size, workers=args.workers, cache_dir=args.cache_dir, cluster=args.cluster,
            progress=progress,
        )
    if not args.output:
        raise SystemExit("moe-data prepare: --output is required with --input")
    spec = PrepareSpec(
        inputs=tuple(args.input), output=args.output, tokenizer=args.tokenizer, seq_len=args.seq_len,
        shard_size=args.shard_size, workers=args.workers, seed=args.seed, vocab_size=args.vocab_size, eos=args.eos,
        cluster=args.cluster, cache_dir=args.cache_dir, parts=args.parts, progress=progress,
        slurm_partition=args.partition, slurm_time_min=args.time_min,
    )
    return prepare(spec)


def _inspect(args: argparse.Namespace) -> dict:
    from moe_launch.trainer.data.dataset import open_dataset
    from moe_launch.trainer.data.shards import read_index
    from moe_launch.trainer.data.tokenizer import load_tokenizer

    info: dict = {"path": args.path, "format": args.format}
    seq_len = args.seq_len
    tok_file = args.tokenizer
    if args.format == "npy":
        index = read_index(args.path)
        info["index"] = {k: v for k, v in index.to_json().items() if k != "shards"}
        info["index"]["num_shards"] = len(index.shards)
        seq_len = seq_len or index.seq_len
        tok_file = tok_file or str(Path(args.path).expanduser() / "tokenizer.json")
    if seq_len is None:
        raise SystemExit("moe-data inspect: --seq-len is required for --format megatron")
    ds = open_dataset(args.path, args.format, seq_len)
    info["instances"] = ds.n_instances
    if tok_file and Path(tok_file).is_file() and args.show > 0:
        tok = load_tokenizer(tok_file)
        rows = ds.rows(list(range(min(args.show, ds.n_instances))))
        info["samples"] = [tok.decode(row.tolist(), skip_special_tokens=False) for row in rows]
    return info


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = _prepare(args) if args.command == "prepare" else _inspect(args)
    except MoeLaunchError as exc:
        print(f"moe-data: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "prepare":
        result.pop("spec", None)
        tps, per_core = result.get("tokens_per_s", 0.0), result.get("tokens_per_s_per_core", 0.0)
        if result.get("already_prepared"):
            done = f"{result['output']} is already prepared ({result['instances']} instances)"
            print(f"moe-data: {done}", file=sys.stderr)
        else:
            print(
                f"moe-data: {result['instances']} instances x {args.seq_len + 1} tokens in {result['shards']} shards "
                f"-> {result['output']}; parts run {result['parts_run']}, skipped {result['parts_skipped']}; "
                f"{tps:,.0f} tokens/s, {per_core:,.0f} tokens/s per core; {result['wall_s']:.1f} s",
                file=sys.stderr,
            )
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
