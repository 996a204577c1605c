"""`moe-data prepare`: text files -> shuffled fixed-size `.npy` shards + `index.json`.

Stages, each restartable (datatrove-style completion markers):
  1. plan: sort the input files (binary ones skipped with a warning; no text at all is refused), split them into
     contiguous parts balanced by bytes (`plan.json`; a rerun reuses it, whatever the worker count, so the output
     never depends on how the work was spread);
  2. tokenize: one task per part (local processes or a Slurm job array) writes `parts/part-XXXXX.npy`, the part's
     concatenated token stream (each document + EOS), then its marker `completions/part-XXXXX.json`; parts with a
     marker are skipped on rerun;
  3. merge: concatenate the parts in order, cut the stream into instances of seq_len+1 tokens (the tail that does not
     fill one is dropped), shuffle them with a seeded permutation across all files, write `shard-XXXXX.npy` files,
     then `index.json` last: its presence means the dataset is complete. index.json's source.fingerprint hashes the
     input files (path, size) and the tokenizer: an --output finished from other inputs is refused, not reused.
The tokenizer is copied into the output (tokenizer.json), so a dataset never depends on a cache directory.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from moe_launch.errors import DataError
from moe_launch.rundir import node_name
from moe_launch.trainer.data import shards
from moe_launch.trainer.data.corpus import BUILTIN_CORPUS_BYTES, read_documents
from moe_launch.trainer.data.permutation import permute
from moe_launch.trainer.data.tokenizer import builtin_tokenizer_path, eos_id, load_tokenizer, vocab_size

PLAN_VERSION = 1
PREPARE_SHUFFLE_EPOCH = 0x5EED  # permutation key (seed, this) is distinct from the loader's (seed, epoch)
_ENCODE_BATCH_CHARS = 4 << 20
_PART_TARGET_BYTES = 128 << 20
_SNIFF_BYTES = 8192
_COMPRESSED = (".gz",)  # gzip'd JSON lines: binary on disk, text inside (corpus.read_documents opens them)


@dataclass(frozen=True)
class PrepareSpec:
    inputs: tuple[str, ...]  # directories (read recursively) or glob patterns
    output: str
    tokenizer: str = "builtin"  # builtin | path/to/tokenizer.json
    seq_len: int = 128
    shard_size: int = 4096
    workers: int = 2
    seed: int = 0
    vocab_size: int = 4096  # size of the built-in BPE (ignored for a tokenizer file)
    eos: Optional[str] = None  # EOS token text; None: guess from the tokenizer
    cluster: str = "local"  # local | slurm
    cache_dir: str = "~/.cache/moe-launch/data"  # where the built-in tokenizer is cached
    builtin_corpus_bytes: int = BUILTIN_CORPUS_BYTES  # text the built-in tokenizer is trained on
    parts: int = 0  # 0: min(files, max(4 * workers, bytes / 128 MB))
    progress: bool = True
    slurm_partition: Optional[str] = None
    slurm_time_min: int = 60


@dataclass(frozen=True)
class PartTask:
    part: int
    files: tuple[str, ...]
    sizes: tuple[int, ...]  # bytes of each file when planned: a marker only counts for files of these sizes
    nbytes: int
    out_dir: str
    tokenizer_file: str
    eos_id: int
    dtype: str


def part_file(out_dir: Path, part: int) -> Path:
    return out_dir / "parts" / f"part-{part:05d}.npy"


def marker_file(out_dir: Path, part: int) -> Path:
    return out_dir / "completions" / f"part-{part:05d}.json"


def part_is_done(task: PartTask) -> bool:
    marker = marker_file(Path(task.out_dir), task.part)
    if not marker.exists() or not part_file(Path(task.out_dir), task.part).exists():
        return False
    try:
        return json.loads(marker.read_text()).get("sizes") == list(task.sizes)
    except json.JSONDecodeError:
        return False


def list_inputs(inputs: tuple[str, ...] | list[str]) -> list[Path]:
    """Every regular, non-hidden file named by `inputs`, deduplicated, in sorted path order."""
    found: set[Path] = set()
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():  # skip hidden files and folders (.git, our own .NAME.tmp.PID files)
            candidates = [p for p in path.rglob("*")
                          if p.is_file() and not any(c.startswith(".") for c in p.relative_to(path).parts)]
        else:
            candidates = [Path(p) for p in glob.glob(str(path), recursive=True)
                          if Path(p).is_file() and not Path(p).name.startswith(".")]
        if not candidates:
            raise DataError(f"--input {item}: no files found; pass a directory or a glob such as 'data/*.jsonl'")
        found.update(p.resolve() for p in candidates)
    return sorted(found)


def is_binary(path: Path) -> bool:
    """A NUL byte or invalid UTF-8 in the first 8 KiB (a multi-byte character cut at the boundary is fine)."""
    if path.name.endswith(_COMPRESSED):
        return False
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return True
    return False


def text_inputs(inputs: tuple[str, ...] | list[str], warn: Callable[[str], None]) -> list[Path]:
    """list_inputs less binary files (each named through `warn`); refuses inputs without a byte of text."""
    files = list_inputs(inputs)
    text = []
    for p in files:
        if is_binary(p):
            warn(f"skipping {p}: binary, not UTF-8 text")
        else:
            text.append(p)
    if not text:
        raise DataError(f"--input {' '.join(inputs)}: all {len(files)} files are binary; pass text, .jsonl or "
                        ".jsonl.gz files")
    if sum(p.stat().st_size for p in text) == 0:
        raise DataError(f"--input {' '.join(inputs)}: the {len(text)} files are empty; nothing to tokenize")
    return text


def input_fingerprint(files: list[tuple[str, int]], tokenizer_sha256: str, eos: int) -> str:
    """Pure: what a prepared dataset was made from (input paths and sizes, tokenizer, EOS id)."""
    blob = json.dumps({"inputs": files, "tokenizer": tokenizer_sha256, "eos": eos}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _warn(message: str) -> None:
    print(f"moe-data: warning: {message}", file=sys.stderr, flush=True)


def plan_parts(sizes: list[int], n_parts: int) -> list[tuple[int, int]]:
    """Split files [0, len(sizes)) into <= n_parts contiguous, non-empty ranges of roughly equal bytes. Pure."""
    n_parts = max(1, min(n_parts, len(sizes)))
    total = sum(sizes)
    ranges, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        files_left, parts_left = len(sizes) - (i + 1), n_parts - len(ranges) - 1
        # close the part at its share of the bytes, or when each remaining part needs one remaining file
        if parts_left > 0 and (acc >= total * (len(ranges) + 1) / n_parts or files_left == parts_left):
            ranges.append((start, i + 1))
            start = i + 1
    ranges.append((start, len(sizes)))
    return [r for r in ranges if r[1] > r[0]]


def tokenize_part(task: PartTask, report: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """Tokenize one part on one core; idempotent (returns the marker of a part already done). `report(part, bytes)`
    is called after each file (the progress bar moves per file, not per part)."""
    marker = marker_file(Path(task.out_dir), task.part)
    if part_is_done(task):  # a requeued Slurm task, or a part finished by an earlier run
        return json.loads(marker.read_text())
    # one core per task, so tokens/s per core is measured, and N tasks do not oversubscribe N cores
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return _tokenize_part(task, marker, report)
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _tokenize_part(task: PartTask, marker: Path, report: Optional[Callable[[int, int], None]]) -> dict[str, Any]:
    out_dir = Path(task.out_dir)
    t0 = time.perf_counter()
    tok = load_tokenizer(task.tokenizer_file)
    dtype = np.dtype(task.dtype)
    pieces: list[np.ndarray] = []
    eos = np.array([task.eos_id], dtype=dtype)
    batch: list[str] = []
    chars = docs = 0

    def flush() -> None:
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            pieces.append(np.asarray(enc.ids, dtype=dtype))
            pieces.append(eos)
        batch.clear()

    for name, size in zip(task.files, task.sizes):
        for text in read_documents(Path(name)):
            batch.append(text)
            chars += len(text)
            docs += 1
            if chars >= _ENCODE_BATCH_CHARS:
                flush()
                chars = 0
        if report is not None:
            report(task.part, size)
    flush()
    tokens_T = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    target = part_file(out_dir, task.part)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}.npy")
    np.save(tmp, tokens_T)
    os.replace(tmp, target)
    record = {
        "part": task.part, "files": len(task.files), "sizes": list(task.sizes), "bytes": task.nbytes, "docs": docs,
        "tokens": int(tokens_T.size), "seconds": time.perf_counter() - t0, "host": node_name(),
    }
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp_marker = marker.with_name(f".{marker.name}.tmp.{os.getpid()}")
    tmp_marker.write_text(json.dumps(record))
    os.replace(tmp_marker, marker)  # the marker goes last: a part without one is redone
    return record


def _tokenizer_source(spec: PrepareSpec) -> Path:
    if spec.tokenizer == "builtin":
        return builtin_tokenizer_path(Path(spec.cache_dir), spec.vocab_size, spec.builtin_corpus_bytes)
    source = Path(spec.tokenizer).expanduser()
    load_tokenizer(source)  # fail early with a clear message
    return source


def _tokenizer_for(spec: PrepareSpec, out_dir: Path) -> tuple[Path, str]:
    """Copy the tokenizer into the output (the dataset then carries what decodes it); returns (file, sha256)."""
    data = _tokenizer_source(spec).read_bytes()
    target = out_dir / "tokenizer.json"
    if not target.exists() or target.read_bytes() != data:
        tmp = target.with_name(f".tokenizer.json.tmp.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return target, hashlib.sha256(data).hexdigest()


def _make_plan(spec: PrepareSpec, out_dir: Path, files: list[Path]) -> dict[str, Any]:
    sizes = [p.stat().st_size for p in files]
    tok_file, tok_sha = _tokenizer_for(spec, out_dir)
    tok = load_tokenizer(tok_file)
    vocab = vocab_size(tok)
    n_parts = spec.parts or max(4 * spec.workers, -(-sum(sizes) // _PART_TARGET_BYTES))
    plan = {
        "version": PLAN_VERSION,
        "inputs": [[str(p), s] for p, s in zip(files, sizes)],
        "tokenizer": spec.tokenizer,
        "tokenizer_sha256": tok_sha,
        "vocab_size": vocab,
        "eos_id": eos_id(tok, spec.eos),
        "dtype": shards.token_dtype(vocab).name,
        "parts": plan_parts(sizes, n_parts),
    }
    plan["fingerprint"] = input_fingerprint(plan["inputs"], tok_sha, plan["eos_id"])
    plan_path = out_dir / "plan.json"
    if plan_path.exists():
        old = json.loads(plan_path.read_text())
        same = all(old.get(k) == plan[k] for k in ("version", "tokenizer_sha256", "eos_id", "dtype"))
        same = same and [f for f, _ in old["inputs"]] == [f for f, _ in plan["inputs"]]
        if not same:
            raise DataError(
                f"--output {out_dir} holds an unfinished preparation of other input files or another tokenizer "
                f"({plan_path}); use a fresh --output directory or delete that one"
            )
        # keep the original split, whatever the worker count; a changed file only invalidates its own part
        plan["parts"] = [tuple(r) for r in old["parts"]]
    tmp = plan_path.with_name(f".plan.json.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(plan, indent=1))
    os.replace(tmp, plan_path)
    return plan


def _tasks(plan: dict[str, Any], out_dir: Path) -> list[PartTask]:
    inputs = plan["inputs"]
    return [
        PartTask(
            part=i,
            files=tuple(inputs[j][0] for j in range(lo, hi)),
            sizes=tuple(inputs[j][1] for j in range(lo, hi)),
            nbytes=sum(inputs[j][1] for j in range(lo, hi)),
            out_dir=str(out_dir),
            tokenizer_file=str(out_dir / "tokenizer.json"),
            eos_id=plan["eos_id"],
            dtype=plan["dtype"],
        )
        for i, (lo, hi) in enumerate(plan["parts"])
    ]


def merge_parts(out_dir: Path, plan: dict[str, Any], spec: PrepareSpec) -> shards.ShardIndex:
    """Concatenate the part streams, cut into [n, seq_len+1] instances, shuffle across all files, write shards."""
    width = spec.seq_len + 1
    dtype = np.dtype(plan["dtype"])
    part_files = [part_file(out_dir, i) for i in range(len(plan["parts"]))]
    lengths = [int(np.load(p, mmap_mode="r").shape[0]) for p in part_files]
    total = sum(lengths)
    n = total // width
    if n == 0:
        raise DataError(
            f"the inputs hold {total} tokens, fewer than one instance of --seq-len+1 = {width}; "
            "add text or lower --seq-len"
        )
    # one on-disk stream, so an instance that straddles two parts is read like any other
    stream_path = out_dir / f".stream.tmp.{os.getpid()}.npy"
    stream = np.lib.format.open_memmap(stream_path, mode="w+", dtype=dtype, shape=(total,))
    offset = 0
    for p, length in zip(part_files, lengths):
        stream[offset:offset + length] = np.load(p, mmap_mode="r")
        offset += length
    stream.flush()
    rows_NL = stream[: n * width].reshape(n, width)
    entries, max_id = [], 0
    for s, first in enumerate(range(0, n, spec.shard_size)):
        ids = permute(np.arange(first, min(first + spec.shard_size, n)), n, (spec.seed, PREPARE_SHUFFLE_EPOCH))
        order = np.argsort(ids)  # read rows in file order, then put them in shuffled order
        rows = np.empty((ids.size, width), dtype=dtype)
        rows[order] = rows_NL[ids[order]]
        max_id = max(max_id, int(rows.max()))
        shards.write_shard(out_dir, s, rows)
        entries.append({"file": shards.shard_name(s), "count": int(ids.size)})
    del stream, rows_NL
    stream_path.unlink()
    return shards.ShardIndex(
        seq_len=spec.seq_len, dtype=dtype.name, vocab_size=plan["vocab_size"], eos_id=plan["eos_id"],
        max_token_id=max_id, shards=entries, tokenizer=spec.tokenizer, seed=spec.seed, shard_size=spec.shard_size,
        total_tokens=n * width, source={"files": len(plan["inputs"]), "tokens": total, "parts": len(plan["parts"]),
                                        "fingerprint": plan["fingerprint"]},
    )


def _fingerprint_of(spec: PrepareSpec, files: list[Path]) -> str:
    """The fingerprint the plan of these inputs would record (the tokenizer read from its source, not copied)."""
    tok_file = _tokenizer_source(spec)
    tok = load_tokenizer(tok_file)
    return input_fingerprint([[str(p), p.stat().st_size] for p in files], hashlib.sha256(tok_file.read_bytes())
                             .hexdigest(), eos_id(tok, spec.eos))


def _existing_index(out_dir: Path, spec: PrepareSpec, files: Optional[list[Path]]) -> Optional[shards.ShardIndex]:
    if not (out_dir / shards.INDEX_NAME).exists():
        return None
    index = shards.read_index(out_dir)
    made_from = index.source.get("fingerprint")
    if made_from is not None and files is not None and made_from != _fingerprint_of(spec, files):
        raise DataError(
            f"--output {out_dir} holds a dataset prepared from other input files or another tokenizer; "
            "use a fresh --output directory, or delete that one to prepare these inputs there"
        )
    wanted = {"seq_len": spec.seq_len, "seed": spec.seed, "shard_size": spec.shard_size}
    have = {k: getattr(index, k) for k in wanted}
    if have != wanted:
        raise DataError(
            f"--output {out_dir} already holds a finished dataset with {have}, not {wanted}; "
            "use a fresh --output directory"
        )
    return index


def _remove_stale_temporaries(out_dir: Path) -> None:
    """Half-written files of a killed run (every write goes to a `.NAME.tmp.PID` file first, then is renamed)."""
    for folder in (out_dir, out_dir / "parts", out_dir / "completions"):
        if folder.is_dir():
            for tmp in folder.glob(".*.tmp.*"):
                tmp.unlink(missing_ok=True)


def prepare(spec: PrepareSpec) -> dict[str, Any]:
    """Run (or finish) a preparation; returns a summary: instances, tokens, parts run/skipped, tokens/s (per core)."""
    from moe_launch.trainer.data.runners import run_local, run_slurm  # runners import rich/submitit lazily

    if spec.seq_len < 1 or spec.shard_size < 1 or spec.workers < 1:
        raise DataError("--seq-len, --shard-size and --workers must be positive integers")
    if spec.cluster not in ("local", "slurm"):
        raise DataError(f"--cluster {spec.cluster!r} is unknown; use local or slurm")
    out_dir = Path(spec.output).expanduser().resolve()
    t0 = time.perf_counter()
    finished = (out_dir / shards.INDEX_NAME).exists()
    inputs_gone = not any(glob.glob(str(Path(i).expanduser())) for i in spec.inputs)
    # a finished dataset whose inputs were removed (the built-in corpus is, after preparing) has nothing to compare
    files = None if finished and inputs_gone else text_inputs(spec.inputs, _warn)
    done = _existing_index(out_dir, spec, files)
    if done is not None:
        return {"output": str(out_dir), "instances": done.total_instances, "already_prepared": True,
                "parts_run": 0, "parts_skipped": done.source.get("parts", 0), "wall_s": time.perf_counter() - t0}
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out_dir)
    plan = _make_plan(spec, out_dir, files or text_inputs(spec.inputs, _warn))
    tasks = _tasks(plan, out_dir)
    pending = [t for t in tasks if not part_is_done(t)]
    t_tok = time.perf_counter()
    if spec.cluster == "slurm":
        records = run_slurm(pending, spec, out_dir)
    else:
        records = run_local(pending, spec.workers, spec.progress)
    tok_wall = time.perf_counter() - t_tok
    index = merge_parts(out_dir, plan, spec)
    shards.write_index(out_dir, index)
    shutil.rmtree(out_dir / "parts", ignore_errors=True)  # the shards now hold every token
    run_tokens = sum(r["tokens"] for r in records)
    run_seconds = sum(r["seconds"] for r in records)
    return {
        "output": str(out_dir),
        "instances": index.total_instances,
        "tokens": index.source["tokens"],
        "shards": len(index.shards),
        "vocab_size": index.vocab_size,
        "parts_run": len(records),
        "parts_skipped": len(tasks) - len(pending),
        "tokens_per_s": run_tokens / tok_wall if records and tok_wall > 0 else 0.0,
        "tokens_per_s_per_core": run_tokens / run_seconds if run_seconds > 0 else 0.0,
        "wall_s": time.perf_counter() - t0,
        "spec": asdict(spec),
    }
