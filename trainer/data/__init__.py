"""Training data: the built-in corpus, tokenizers, `moe-data prepare`, shards, the Megatron reader and the loader.

The trainer needs two calls:
    path = resolve_dataset(cfg.data, cfg.train.seq_len, cfg.model.vocab_size)
    loader = TokenLoader(path, cfg.data.format, seq_len, global_batch, data_rank, data_size, seed, vocab_size)
    tokens_BL = loader.get(step)          # int64 [global_batch / data_size, seq_len + 1]

Exports resolve lazily: the tokenization worker processes import this package and must not pay for importing torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "PrepareSpec": "prepare",
    "prepare": "prepare",
    "TokenDataset": "dataset",
    "open_dataset": "dataset",
    "TokenLoader": "loader",
    "prepare_builtin": "builtin",
    "resolve_dataset": "builtin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"moe_launch.trainer.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
