"""Fixtures of the data tests: a small real corpus (a few stdlib modules), a tokenizer trained on it, a dataset."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import TINY_VOCAB, copy_small_corpus, small_spec
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_launch.trainer.data.prepare import prepare
from moe_launch.trainer.data.tokenizer import EOS


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    return copy_small_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def tiny_tokenizer(small_corpus, tmp_path_factory) -> Path:
    """A byte-level BPE trained on the small corpus; also proves that any tokenizer.json path works."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([p.read_text() for p in sorted(small_corpus.iterdir())], trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def small_dataset(small_corpus, tiny_tokenizer, tmp_path_factory) -> Path:
    """Prepared with 2 worker processes (the parallel path)."""
    out = tmp_path_factory.mktemp("ds") / "small"
    prepare(small_spec(small_corpus, tiny_tokenizer, out, workers=2))
    return out
