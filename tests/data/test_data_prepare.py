"""`moe-data prepare`: parallel tokenization, shard round trip, shuffle across files, resumability, the CLI."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import TINY_VOCAB, small_spec

from moe_launch.errors import DataError
from moe_launch.trainer.data.permutation import permute
from moe_launch.trainer.data.prepare import (
    PREPARE_SHUFFLE_EPOCH,
    list_inputs,
    marker_file,
    plan_parts,
    prepare,
)
from moe_launch.trainer.data.shards import read_index
from moe_launch.trainer.data.tokenizer import load_tokenizer


def _all_rows(path: Path) -> np.ndarray:
    index = read_index(path)
    return np.concatenate([np.load(path / s["file"]) for s in index.shards])


def _expected_stream(corpus: Path, tokenizer: Path) -> np.ndarray:
    """Independent of prepare(): every file in sorted order, tokenized, each followed by EOS."""
    tok = load_tokenizer(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for path in sorted(p.resolve() for p in corpus.iterdir()):
        ids += tok.encode(path.read_text(), add_special_tokens=False).ids + [eos]
    return np.asarray(ids)


def test_plan_parts_contiguous_balanced():
    assert plan_parts([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert plan_parts([100, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]
    assert plan_parts([5, 5], 8) == [(0, 1), (1, 2)]  # never more parts than files
    ranges = plan_parts([3, 1, 4, 1, 5, 9, 2, 6], 3)
    assert ranges[0][0] == 0 and ranges[-1][1] == 8
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_prepare_two_workers_round_trip(small_dataset, small_corpus, tiny_tokenizer):
    index = read_index(small_dataset)
    stream = _expected_stream(small_corpus, tiny_tokenizer)
    width = index.seq_len + 1
    n = stream.size // width
    assert (index.seq_len, index.dtype, index.vocab_size, index.seed) == (32, "uint16", TINY_VOCAB, 3)
    assert index.total_instances == n and index.source["tokens"] == stream.size
    assert [s["count"] for s in index.shards[:-1]] == [50] * (len(index.shards) - 1)
    assert 0 < index.shards[-1]["count"] <= 50
    for s in index.shards:
        arr = np.load(small_dataset / s["file"], mmap_mode="r")
        assert arr.dtype == np.uint16 and arr.shape == (s["count"], width)
    rows = _all_rows(small_dataset)
    instances = stream[: n * width].reshape(n, width)
    # exactly the instances of the concatenated stream, each once ...
    assert np.array_equal(np.unique(rows, axis=0), np.unique(instances, axis=0))
    # ... in the seeded order, which mixes files: neighbours on disk come from far apart in the stream
    source = permute(np.arange(n), n, (3, PREPARE_SHUFFLE_EPOCH))
    assert np.array_equal(rows, instances[source])
    assert not np.array_equal(source, np.arange(n))
    assert index.max_token_id == int(rows.max())


def test_output_independent_of_worker_count(small_dataset, small_corpus, tiny_tokenizer, tmp_path):
    prepare(small_spec(small_corpus, tiny_tokenizer, tmp_path / "one", workers=1))
    assert np.array_equal(_all_rows(tmp_path / "one"), _all_rows(small_dataset))


def test_seed_changes_order_not_content(small_dataset, small_corpus, tiny_tokenizer, tmp_path):
    prepare(small_spec(small_corpus, tiny_tokenizer, tmp_path / "s4", seed=4))
    a, b = _all_rows(small_dataset), _all_rows(tmp_path / "s4")
    assert not np.array_equal(a, b)
    assert np.array_equal(np.unique(a, axis=0), np.unique(b, axis=0))


def test_resume_skips_completed_parts(small_dataset, small_corpus, tiny_tokenizer, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in sorted(small_corpus.iterdir()):
        (corpus / p.name).write_text(p.read_text())
    broken = corpus / "zz_broken.jsonl"  # sorts last: the last part fails, the others complete
    broken.write_text('{"text": "fine"}\nnot json\n')
    out = tmp_path / "out"
    spec = small_spec(corpus, tiny_tokenizer, out, workers=2, parts=4)
    with pytest.raises(DataError, match="re-run the same command"):
        prepare(spec)
    done = sorted(p.name for p in (out / "completions").iterdir())
    assert len(done) == 3 and not (out / "index.json").exists()
    broken.write_text('{"text": "fine"}\n{"text": "now valid"}\n')
    # a file of a finished part that changed on disk invalidates that part too, and only it
    first = corpus / sorted(p.name for p in corpus.iterdir())[0]
    first.write_text(first.read_text() + "\n# appended\n")
    summary = prepare(spec)
    assert (summary["parts_run"], summary["parts_skipped"]) == (2, 2)
    assert marker_file(out, 3).exists()
    again = prepare(spec)
    assert again["already_prepared"] and again["parts_run"] == 0
    resumed_rows = _all_rows(out)
    (corpus / "new.txt").write_text("another file")
    (out / "index.json").unlink()
    with pytest.raises(DataError, match="unfinished preparation of other input files"):
        prepare(spec)
    (corpus / "new.txt").unlink()
    # the resumed result equals a clean run over the same files
    clean = prepare(small_spec(corpus, tiny_tokenizer, tmp_path / "clean", workers=1, parts=4))
    assert clean["instances"] == summary["instances"]
    assert np.array_equal(resumed_rows, _all_rows(tmp_path / "clean"))


def test_finished_output_with_other_settings_is_refused(small_dataset, small_corpus, tiny_tokenizer):
    with pytest.raises(DataError, match="already holds a finished dataset"):
        prepare(small_spec(small_corpus, tiny_tokenizer, small_dataset, seq_len=16))


def test_bad_inputs(tmp_path, small_corpus, tiny_tokenizer):
    with pytest.raises(DataError, match="no files found"):
        list_inputs([str(tmp_path / "nothing-*.txt")])
    with pytest.raises(DataError, match="tokenizer file"):
        prepare(small_spec(small_corpus, tmp_path / "missing.json", tmp_path / "o1"))
    with pytest.raises(DataError, match="fewer than one instance"):
        prepare(small_spec(small_corpus, tiny_tokenizer, tmp_path / "o2", seq_len=10**7))


def test_jsonl_documents(tmp_path, tiny_tokenizer):
    src = tmp_path / "in"
    src.mkdir()
    docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)]
    (src / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    summary = prepare(small_spec(src, tiny_tokenizer, tmp_path / "o", seq_len=8, parts=1))
    tok = load_tokenizer(tiny_tokenizer)
    expected = sum(len(tok.encode(d, add_special_tokens=False).ids) + 1 for d in docs)
    assert summary["tokens"] == expected


def test_cli_prepare_and_errors(tmp_path, small_corpus, tiny_tokenizer):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "moe_launch.trainer.data.cli", "prepare", "--input", str(small_corpus / "*.py"),
           "--output", str(out), "--tokenizer", str(tiny_tokenizer), "--seq-len", "32", "--shard-size", "64",
           "--workers", "2", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["instances"] == read_index(out).total_instances
    assert "tokens/s per core" in done.stderr
    bad_cmd = cmd[:5] + [str(tmp_path / "none")] + cmd[6:7] + [str(tmp_path / "other")] + cmd[8:]
    bad = subprocess.run(bad_cmd, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no files found" in bad.stderr


@pytest.mark.slurm
def test_slurm_array_matches_local(slurm_cluster, small_dataset, small_corpus, tiny_tokenizer, tmp_path):
    """The same parts tokenized by a Slurm job array (submitit) give the same dataset as local processes."""
    out = tmp_path / "slurm"
    summary = prepare(small_spec(small_corpus, tiny_tokenizer, out, workers=2, cluster="slurm", slurm_time_min=5))
    assert (summary["parts_run"], summary["parts_skipped"]) == (4, 0)
    hosts = {json.loads(p.read_text())["host"] for p in (out / "completions").iterdir()}
    assert hosts <= set(slurm_cluster.nodes)
    assert np.array_equal(_all_rows(out), _all_rows(small_dataset))


def test_killed_run_resumes_from_markers(small_corpus, tiny_tokenizer, tmp_path):
    """SIGKILL `moe-data prepare` once some parts are marked done; the rerun skips exactly those parts."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for copy in range(4):  # 32 files, 16 parts: the run is still tokenizing when the first marker appears
        for p in sorted(small_corpus.iterdir()):
            (corpus / f"{copy}_{p.name}").write_text(p.read_text())
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "moe_launch.trainer.data.cli", "prepare", "--input", str(corpus), "--output",
           str(out), "--tokenizer", str(tiny_tokenizer), "--seq-len", "32", "--shard-size", "50", "--workers", "1",
           "--parts", "16", "--seed", "3", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    markers = out / "completions"
    try:
        while proc.poll() is None and not (markers.is_dir() and any(markers.glob("part-*.json"))):
            time.sleep(0.002)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert not (out / "index.json").exists(), "the run finished before it could be killed"
    done_before = len(list(markers.glob("part-*.json")))
    assert 1 <= done_before < 16
    summary = prepare(small_spec(corpus, tiny_tokenizer, out, workers=2, parts=16))
    assert (summary["parts_skipped"], summary["parts_run"]) == (done_before, 16 - done_before)
    assert not list(out.glob(".*.tmp.*")) and not list(out.glob("parts/.*.tmp.*"))
    prepare(small_spec(corpus, tiny_tokenizer, tmp_path / "clean", workers=1, parts=16))
    assert np.array_equal(_all_rows(out), _all_rows(tmp_path / "clean"))


def test_cli_inspect_decodes_instances(small_dataset, capsys):
    from moe_launch.trainer.data.cli import main

    assert main(["inspect", str(small_dataset), "--show", "2"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["instances"] == read_index(small_dataset).total_instances
    assert len(info["samples"]) == 2 and all(isinstance(s, str) and s for s in info["samples"])
    assert main(["inspect", str(small_dataset / "missing")]) == 2
    assert "moe-data prepare" in capsys.readouterr().err
