"""The data pipeline's typed configs (Hydra group ``data``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TokenizerConfig:
    # "gpt2" (byte-level BPE vocab.json+merges.txt), "sentencepiece" (tokenizer.model),
    # "hf" (any AutoTokenizer directory or hub id), "trained_bpe" (train once on the corpus, cache)
    kind: str = "trained_bpe"
    path: Optional[str] = None        # local dir or hub id; None = the kind's default hub id
    vocab_size: int = 8192            # only for trained_bpe
    cache_dir: Optional[str] = None   # trained_bpe cache; None = ~/.cache/scape_train/tokenizers
    train_max_bytes: int = 64_000_000  # trained_bpe: train on at most this much training text


@dataclass
class DataConfig:
    # "openwebtext" | "slimpajama6b" | "fineweb" | "local" | "classics" (the sample shipped in-repo);
    # any name other than local/classics is read from the hub at `path`.
    source: str = "classics"
    path: Optional[str] = None        # hub id (hub sources) or file/glob/dir (local)
    revision: Optional[str] = None    # hub revision (e.g. a parquet branch)
    name: Optional[str] = None        # hub config name
    data_dir: Optional[str] = None    # hub: sub-directory holding the data (e.g. a parquet branch's config)
    val_path: Optional[str] = None    # local: validation file/glob/dir (default: files named like val_split)
    text_field: str = "text"          # the records' field holding the text
    train_split: str = "train"        # hub split; local: files/dirs named after it
    val_split: Optional[str] = "validation"   # None: hold out the first val_docs documents
    val_docs: int = 200               # with val_split=null: documents held out for validation
    val_tokens: int = 65536           # fixed validation set size, in tokens
    seq_len: int = 256                # tokens per training sequence (<= model.max_seq_len)
    shuffle_buffer: int = 0           # 0 = stream order; N = shuffle windows of N documents
    num_workers: int = 1              # 0 = in the trainer's thread; N = a background thread (+ N-1 tokenizer processes)
    prefetch: int = 8                 # batches queued ahead by the background thread
    seed: int = 1234                  # data order: shard order and shuffle windows
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
