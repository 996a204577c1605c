"""`moe-data prepare` inputs and outputs: several --input values and quoted globs, binary files skipped with a warning,
empty inputs refused, an --output made from other inputs refused (index.json fingerprint), the tokenizer copied into
the dataset, and a progress bar that moves per file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_helpers import small_spec

from moe_launch.errors import DataError
from moe_launch.trainer.data.prepare import PartTask, is_binary, prepare, text_inputs, tokenize_part
from moe_launch.trainer.data.runners import _Bar, run_local
from moe_launch.trainer.data.shards import read_index

MOE_DATA = str(Path(sys.executable).with_name("moe-data"))


def _rows(path: Path) -> np.ndarray:
    return np.concatenate([np.load(path / s["file"]) for s in read_index(path).shards])


@pytest.fixture()
def split_corpus(small_corpus, tmp_path) -> tuple[Path, Path]:
    """The small corpus split over two folders, the second as .txt files (for a glob), plus a binary file."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    for i, p in enumerate(sorted(small_corpus.iterdir())):
        shutil.copy(p, (a / p.name) if i % 2 else (b / f"{p.stem}.txt"))
    (b / "image.bin").write_bytes(bytes(range(256)) * 8)  # NUL bytes: binary
    (b / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))  # not UTF-8: skipped too
    return a, b


def test_several_inputs_and_a_quoted_glob(split_corpus, tiny_tokenizer, tmp_path):
    a, b = split_corpus
    proc = subprocess.run([MOE_DATA, "prepare", "--input", str(a), "--input", f"{b}/*.txt", "--output",
                           str(tmp_path / "two"), "--tokenizer", str(tiny_tokenizer), "--seq-len", "32",
                           "--shard-size", "50", "--workers", "1", "--parts", "4", "--seed", "3", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "latin1.txt: binary" in proc.stderr and "image.bin" not in proc.stderr  # the glob did not name it
    index = read_index(tmp_path / "two")
    assert index.source["files"] == 8 and index.total_instances == len(_rows(tmp_path / "two")) > 0
    # the tokenizer travels with the dataset
    assert (tmp_path / "two" / "tokenizer.json").read_bytes() == tiny_tokenizer.read_bytes()


def test_binary_files_are_skipped_with_a_warning(split_corpus, small_corpus, tiny_tokenizer, tmp_path):
    a, b = split_corpus
    warnings: list[str] = []
    files = text_inputs((str(a), str(b)), warnings.append)
    assert len(files) == 8 and sorted(Path(w.split()[1].rstrip(":")).name for w in warnings) == ["image.bin",
                                                                                                   "latin1.txt"]
    assert is_binary(b / "image.bin") and not is_binary(a / sorted(p.name for p in a.iterdir())[0])
    # a multi-byte character cut at the sniffing boundary is still text
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"x" * 8191 + "\u00e9".encode())
    assert not is_binary(cut)


def test_empty_and_all_binary_inputs_are_refused(tmp_path, tiny_tokenizer):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        prepare(small_spec(empty, tiny_tokenizer, tmp_path / "out1"))
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "x.bin").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match="binary"):
        prepare(small_spec(binary, tiny_tokenizer, tmp_path / "out2"))
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


def test_an_output_made_from_other_inputs_is_refused(split_corpus, tiny_tokenizer, tmp_path):
    a, b = split_corpus
    out = tmp_path / "out"
    first = prepare(small_spec(a, tiny_tokenizer, out))
    assert read_index(out).source["fingerprint"]
    again = prepare(small_spec(a, tiny_tokenizer, out))
    assert again["already_prepared"] and again["instances"] == first["instances"]
    with pytest.raises(DataError, match="other input files"):
        prepare(small_spec(b, tiny_tokenizer, out))
    (a / sorted(p.name for p in a.iterdir())[0]).write_text("changed\n")  # same path, other content size
    with pytest.raises(DataError, match="other input files"):
        prepare(small_spec(a, tiny_tokenizer, out))


def test_progress_moves_per_file(small_corpus, tiny_tokenizer, tmp_path):
    files = sorted(small_corpus.iterdir())
    sizes = tuple(p.stat().st_size for p in files)
    task = PartTask(part=0, files=tuple(map(str, files)), sizes=sizes, nbytes=sum(sizes), out_dir=str(tmp_path),
                    tokenizer_file=str(tiny_tokenizer), eos_id=0, dtype="uint16")
    seen: list[tuple[int, int]] = []
    tokenize_part(task, lambda part, nbytes: seen.append((part, nbytes)))
    assert seen == [(0, s) for s in sizes]
    # the bar's counts: per file from reports, the rest of a part when it finishes without reports
    halves = [PartTask(i, task.files[4 * i:4 * i + 4], sizes[4 * i:4 * i + 4], sum(sizes[4 * i:4 * i + 4]),
                       str(tmp_path / f"h{i}"), str(tiny_tokenizer), 0, "uint16") for i in (0, 1)]
    bar = _Bar(False, halves, "test")
    bar.file_done(0, sizes[0])
    assert (bar.files, bar.progress.tasks[0].completed) == (1, sizes[0])
    bar.done(halves[0], {"tokens": 10, "seconds": 0.1})
    bar.done(halves[1], {"tokens": 10, "seconds": 0.1})
    assert (bar.files, bar.progress.tasks[0].completed) == (8, sum(sizes))
    # two spawned workers report through the queue
    records = run_local([PartTask(i, h.files, h.sizes, h.nbytes, str(tmp_path / "w"), h.tokenizer_file, 0, "uint16")
                         for i, h in enumerate(halves)], workers=2, progress=False)
    assert sorted(r["part"] for r in records) == [0, 1]
