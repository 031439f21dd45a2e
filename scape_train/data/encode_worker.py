"""Tokenization in worker processes, for the training loader's pool (``data.num_workers`` > 1).

A process tokenizes without the trainer's global interpreter lock: the Rust tokenizer releases
it, but turning its output into Python lists, and the loader's other Python work, would otherwise
share one lock with the training loop's Python. Each worker rebuilds the tokenizer from its JSON
serialization (``tokenizers.Tokenizer.to_str``) once and returns each document's ids as an int32
array: one buffer to pickle per document, not one Python int per token. The loader consumes the
results in submission order, so the token stream, and so every batch and resume state, is the
same as tokenizing in the loader's own thread.

This module imports neither torch nor the rest of the package, so a worker starts in well under a
second.
"""

from __future__ import annotations

import os

import numpy as np

_TOKENIZER = None


def init(spec: str) -> None:
    """Worker initializer: the tokenizer from ``spec`` (``tokenizers.Tokenizer.to_str()``)."""
    global _TOKENIZER
    # one core per worker: the pool is the parallelism (rayon threads in every worker would
    # oversubscribe the host the trainer runs on)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_str(spec)


def encode(texts: list[str]) -> list[np.ndarray]:
    """Each text's ids (no special tokens), as int32 arrays."""
    return [np.asarray(e.ids, dtype=np.int32)
            for e in _TOKENIZER.encode_batch(texts, add_special_tokens=False)]
