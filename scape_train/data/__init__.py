"""The data pipeline: streaming sources, tokenizers, packing, an exactly resumable per-rank loader.

    tok = build_tokenizer(cfg)                                    # cfg: DataConfig
    loader = build_train_loader(cfg, tok, micro_batch_size, rank, world_size)
    inputs, targets = next(loader)                                # LongTensor [B, seq_len] each
    state = loader.state_dict(); ...; loader.load_state_dict(state)
    val = build_val_batches(cfg, tok, micro_batch_size, rank, world_size)
"""

from scape_train.data.config import DataConfig, TokenizerConfig
from scape_train.data.hub import HubUnavailableError
from scape_train.data.loader import TrainLoader, build_train_loader, build_val_batches
from scape_train.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["DataConfig", "TokenizerConfig", "Tokenizer", "TrainLoader", "HubUnavailableError",
           "build_tokenizer", "build_train_loader", "build_val_batches"]
