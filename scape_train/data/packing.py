"""Pack documents into fixed blocks: doc EOS doc EOS ... cut every ``block_len`` tokens.

No padding and no dropped tokens: a document that does not fit continues in the next block, and
the concatenated blocks are exactly the EOS-joined token stream. The tokens not yet emitted are
the packer's state (saved with the loader), so a resume continues mid-document.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class Packer:
    def __init__(self, block_len: int, eos_id: int):
        if block_len < 2:
            raise ValueError(f"block_len must be >= 2 (seq_len + 1), got {block_len}")
        self.block_len = block_len
        self.eos_id = eos_id
        self._buf = np.zeros(0, dtype=np.int64)
        self._pos = 0                     # first token of _buf not yet emitted

    def __len__(self) -> int:
        return len(self._buf) - self._pos

    def add(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document and its EOS."""
        doc = np.asarray(ids, dtype=np.int64)
        # Compact while appending: the pending tail is short (< block_len) in the common case.
        self._buf = np.concatenate([self._buf[self._pos:], doc, np.array([self.eos_id], dtype=np.int64)])
        self._pos = 0

    def has_block(self) -> bool:
        return len(self) >= self.block_len

    def pop(self) -> np.ndarray:
        if not self.has_block():
            raise IndexError("not enough tokens for a block")
        block = self._buf[self._pos:self._pos + self.block_len]
        self._pos += self.block_len
        return block

    def state_dict(self) -> dict:
        return {"tokens": torch.from_numpy(self._buf[self._pos:].copy())}

    def load_state_dict(self, state: dict) -> None:
        self._buf = state["tokens"].to(torch.int64).numpy().copy()
        self._pos = 0
