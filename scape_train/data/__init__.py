"""The data pipeline: streaming sources, tokenizers, packing, an exactly resumable per-rank loader.

    tok = build_tokenizer(cfg)                                    # cfg: DataConfig
    loader = build_train_loader(cfg, tok, micro_batch_size, rank, world_size)
    inputs, targets = next(loader)                                # LongTensor [B, seq_len] each
    state = loader.state_dict(); ...; loader.load_state_dict(state)
    val = build_val_batches(cfg, tok, micro_batch_size, rank, world_size)

The names are imported on first use, so that a tokenizer worker process
(:mod:`.encode_worker`) imports this package without torch.
"""

from __future__ import annotations

import importlib

_WHERE = {"DataConfig": "config", "TokenizerConfig": "config", "HubUnavailableError": "hub",
          "TrainLoader": "loader", "build_train_loader": "loader", "build_val_batches": "loader",
          "Tokenizer": "tokenizer", "build_tokenizer": "tokenizer"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = sorted(_WHERE)
