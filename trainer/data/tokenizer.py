"""Tokenizers: the built-in byte-level BPE (trained on the built-in corpus, cached) or any HF `tokenizer.json`.

A document becomes its token ids followed by one EOS id, so documents can be concatenated into a single stream.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_launch.errors import DataError
from moe_launch.trainer.data.corpus import BUILTIN_CORPUS_BYTES, builtin_documents, python_tag

EOS = "<|endoftext|>"
BUILTIN_TOKENIZER_VERSION = 1
# EOS spellings of common tokenizer.json files, tried in order when the caller does not name one
_EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


def train_builtin(vocab_size: int, max_bytes: int = BUILTIN_CORPUS_BYTES) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization, 256 byte symbols + merges) with EOS as id 0."""
    if vocab_size < 257 + 1:
        raise DataError(
            f"a byte-level BPE needs vocab_size > 257 (256 bytes + EOS), got {vocab_size}; raise model.vocab_size"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_documents(max_bytes), trainer=trainer)
    return tok


def builtin_tokenizer_path(cache_dir: Path, vocab_size: int, max_bytes: int = BUILTIN_CORPUS_BYTES) -> Path:
    """Train the built-in tokenizer once per (vocab, corpus) and cache it; concurrent callers are safe."""
    tag = f"v{BUILTIN_TOKENIZER_VERSION}-{python_tag()}-{vocab_size}-{max_bytes}"
    path = Path(cache_dir).expanduser() / f"tokenizer-builtin-{hashlib.sha1(tag.encode()).hexdigest()[:12]}.json"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    train_builtin(vocab_size, max_bytes).save(str(tmp))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(
            f"tokenizer file {path} does not exist (data.tokenizer / --tokenizer); "
            "use `builtin` or the path of a HF tokenizer.json"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"cannot read tokenizer {path}: {exc}; pass a HF tokenizer.json (data.tokenizer)") from exc


def eos_id(tok: Tokenizer, eos: str | None = None) -> int:
    """The id of the end-of-document token: `eos` if given, else the first known spelling the tokenizer has."""
    for name in (eos,) if eos else _EOS_CANDIDATES:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    tried = eos or ", ".join(_EOS_CANDIDATES)
    raise DataError(f"the tokenizer has no end-of-document token ({tried}); name it with --eos TOKEN")


def vocab_size(tok: Tokenizer) -> int:
    return tok.get_vocab_size(with_added_tokens=True)
