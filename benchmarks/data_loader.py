"""How long TokenLoader.get(step) takes, against the step it feeds (the loader must stay under 1% of a step).

    .venv/bin/python benchmarks/data_loader.py [--steps 2000] [--json out.json]

Cases (per-rank batch shapes):
  tiny          the built-in dataset, seq_len 128, global batch 8 on 1 rank: [8, 129] (the demo)
  olmoe-npy     synthetic prepared shards, seq_len 4096, 4 sequences per rank of dp=8: [4, 4097]
  olmoe-megatron the same shape read from a Megatron .bin/.idx pair
Each case is timed in the first epoch (sequential rows for npy) and in a later epoch (permuted rows). Page cache is
warm after the first pass; a cold first read costs one disk read of 32 KB per row, which the OS read-ahead hides.
The tiny case is compared with a measured tiny_moe training step on this CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moe_launch.conf.schema import DataConfig
from moe_launch.trainer.data.builtin import resolve_dataset
from moe_launch.trainer.data.loader import TokenLoader
from moe_launch.trainer.data.megatron import write_indexed_dataset
from moe_launch.trainer.data.shards import ShardIndex, shard_name, write_index, write_shard

OLMOE_VOCAB = 50304


def _time_gets(loader: TokenLoader, steps: range) -> dict[str, float]:
    times = []
    for step in steps:
        t0 = time.perf_counter()
        loader.get(step)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"median_us": statistics.median(times) * 1e6, "p99_us": times[int(0.99 * (len(times) - 1))] * 1e6,
            "max_us": times[-1] * 1e6}


def _synthetic_npy(root: Path, n: int, seq_len: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shard_size = 512
    entries = []
    for s, first in enumerate(range(0, n, shard_size)):
        count = min(shard_size, n - first)
        write_shard(root, s, rng.integers(0, OLMOE_VOCAB, size=(count, seq_len + 1), dtype=np.uint16))
        entries.append({"file": shard_name(s), "count": count})
    write_index(root, ShardIndex(seq_len=seq_len, dtype="uint16", vocab_size=OLMOE_VOCAB, eos_id=0,
                                 max_token_id=OLMOE_VOCAB - 1, shards=entries, tokenizer="synthetic", seed=0,
                                 shard_size=shard_size))
    return root


def _synthetic_megatron(prefix: Path, tokens: int) -> Path:
    rng = np.random.default_rng(1)
    lengths = rng.integers(200, 3000, size=tokens // 1600)
    write_indexed_dataset(prefix, (rng.integers(0, OLMOE_VOCAB, size=int(k), dtype=np.uint16) for k in lengths))
    return prefix


def _tiny_step_ms(batch_BL: torch.Tensor, repeats: int = 10) -> float | None:
    """Median fwd+bwd+AdamW step of tiny_moe on this CPU; None if the model package is unavailable."""
    try:
        from moe_launch.conf.presets import MODELS
        from moe_launch.trainer.model import build_model
    except ImportError:
        return None
    torch.manual_seed(0)
    model = build_model(MODELS["tiny_moe"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        loss, _parts = model.compute_loss(batch_BL[:, :-1], batch_BL[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def _olmoe_step_ms(batch_BL: torch.Tensor, repeats: int = 5) -> float | None:
    """Median fwd+bwd of olmoe_1b7b (bf16 weights, reference MoE) on one GPU for one rank's batch; None without CUDA.

    A lower bound of the real step (no optimizer, no communication), so loader/step computed with it is an upper bound.
    """
    if not torch.cuda.is_available():
        return None
    from moe_launch.conf.presets import MODELS
    from moe_launch.trainer.model import build_model

    torch.manual_seed(0)
    model = build_model(MODELS["olmoe_1b7b"], device="cuda").to(torch.bfloat16)
    tokens = batch_BL.cuda()
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, _parts = model.compute_loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.cuda.synchronize()  # note: a host-device sync, so the wall clock covers the GPU work
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[2:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--cache-dir", default=DataConfig().cache_dir, help="where the built-in dataset lives")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--no-model", action="store_true", help="skip timing the tiny_moe step")
    parser.add_argument("--olmoe-step", action="store_true", help="also time an olmoe_1b7b fwd+bwd on the GPU")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (trainer ranks use 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results: dict[str, dict] = {}

    t0 = time.perf_counter()
    tiny_path = resolve_dataset(DataConfig(cache_dir=args.cache_dir), 128, 4096)
    results["builtin_resolve_s"] = {"seconds": time.perf_counter() - t0}
    tiny = TokenLoader(tiny_path, "npy", 128, 8, 0, 1, seed=0, vocab_size=4096)
    epoch = tiny.n_instances // 8
    results["tiny [8,129] epoch0"] = _time_gets(tiny, range(args.steps))
    results["tiny [8,129] epoch1+"] = _time_gets(tiny, range(epoch + 1, epoch + 1 + args.steps))

    with tempfile.TemporaryDirectory() as tmp:
        npy = _synthetic_npy(Path(tmp) / "npy", n=4096, seq_len=4096)
        for label, first in (("epoch0", 0), ("epoch1+", 4096 // 32 + 1)):
            loader = TokenLoader(npy, "npy", 4096, 32, 3, 8, seed=0, vocab_size=OLMOE_VOCAB)
            _time_gets(loader, range(first, first + 50))  # warm the page cache
            results[f"olmoe-npy [4,4097] rank3/8 {label}"] = _time_gets(loader, range(first, first + args.steps))
        meg = _synthetic_megatron(Path(tmp) / "meg", tokens=16_000_000)
        loader = TokenLoader(meg, "megatron", 4096, 32, 3, 8, seed=0, vocab_size=OLMOE_VOCAB)
        _time_gets(loader, range(50))
        results["olmoe-megatron [4,4097] rank3/8"] = _time_gets(loader, range(args.steps))
        olmoe_ms = _olmoe_step_ms(loader.get(0)) if args.olmoe_step else None
        if olmoe_ms is not None:
            worst = max(v["median_us"] for k, v in results.items() if k.startswith("olmoe"))
            results["olmoe_1b7b fwd+bwd [4,4096] (GPU, bf16)"] = {"median_ms": olmoe_ms,
                                                                   "loader_share": worst / 1e3 / olmoe_ms}

    step_ms = None if args.no_model else _tiny_step_ms(tiny.get(0))
    if step_ms is not None:
        share = results["tiny [8,129] epoch1+"]["median_us"] / 1e3 / step_ms
        results["tiny_moe step (fwd+bwd+adamw, CPU)"] = {"median_ms": step_ms, "loader_share": share}

    for name, values in results.items():
        print(f"{name:42s} " + "  ".join(f"{k}={v:.3%}" if k.endswith("share") else f"{k}={v:,.1f}"
                                           for k, v in values.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
