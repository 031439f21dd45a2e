"""A key/value cache for incremental decoding (``model(ids, cache=cache)``).

The training forward never sees it: ``model(ids)`` is unchanged. With a cache, each call feeds
only the new tokens; every attention layer appends their keys/values and attends over everything
cached so far, so a step costs O(length) instead of recomputing the whole prefix.

Batches of prompts of different lengths are LEFT-padded: row ``b`` starts with ``pad[b]`` filler
tokens that no real token attends to, and its positions (GPT position table, Llama RoPE) start at
0 at its first real token, as if it were alone. A filler token attends only to itself, so no row
of the attention is empty (an empty row would make NaNs that then leak through 0 x NaN).

Tensors are allocated on the first write of each layer, with the keys' own dtype and device (so
bf16 autocast caches bf16).
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys and values, [batch, n_kv_heads, max_len, head_dim]."""

    def __init__(self, parent: "KVCache"):
        self.parent = parent
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new ``k, v`` [B, H_kv, t, hd] at the current length; all cached so far."""
        p = self.parent
        start, t = p.length, k.shape[2]
        if self.k is None:
            shape = (k.shape[0], k.shape[1], p.max_len, k.shape[3])
            self.k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.k[:, :, start:start + t] = k
        self.v[:, :, start:start + t] = v
        return self.k[:, :, :start + t], self.v[:, :, :start + t]


class KVCache:
    """Keys/values of every layer of one model for one batch of sequences.

    ``pad`` (int tensor [batch]) is the number of left-padding tokens of each row; None = none.
    The model calls ``begin(t)`` before its layers (positions and the attention mask of the ``t``
    new tokens) and ``end(t)`` after them (the length advances).
    """

    def __init__(self, n_layers: int, max_len: int, pad: torch.Tensor | None = None):
        if max_len <= 0:
            raise ValueError(f"max_len must be > 0, got {max_len}")
        self.max_len = max_len
        self.length = 0
        self.pad = None if pad is None or not bool((pad > 0).any()) else pad.to(torch.long)
        self.layers = [LayerCache(self) for _ in range(n_layers)]
        self.attn_mask: torch.Tensor | None = None
        self.is_causal = False

    def __len__(self) -> int:
        return self.length

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """Positions of the next ``t`` tokens: [t] without padding, else [B, t] (fillers at 0)."""
        pos = torch.arange(self.length, self.length + t, device=device)
        if self.pad is None:
            return pos
        return (pos[None, :] - self.pad.to(device)[:, None]).clamp_min(0)

    def begin(self, t: int, device: torch.device) -> None:
        if self.length + t > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; {self.length} are used and "
                             f"{t} more were fed")
        total = self.length + t
        if self.pad is None:
            # No padding: a fresh prefill is plain causal attention (the training kernel), and a
            # later chunk attends to everything before it plus causally within itself.
            self.is_causal = self.length == 0 and t > 1
            if self.is_causal or t == 1:
                self.attn_mask = None
                return
        self.is_causal = False
        q_pos = torch.arange(self.length, total, device=device)[:, None]      # [t, 1]
        k_pos = torch.arange(total, device=device)[None, :]                   # [1, L]
        mask = k_pos <= q_pos                                                 # [t, L]
        if self.pad is not None:
            real = k_pos >= self.pad.to(device)[:, None, None]                # [B, 1, L]
            mask = mask & (real | (k_pos == q_pos))                           # [B, t, L]
        self.attn_mask = mask.unsqueeze(-3) if mask.dim() == 3 else mask      # [B, 1, t, L]

    def end(self, t: int) -> None:
        self.length += t
        self.attn_mask = None
        self.is_causal = False


def new_cache(model: torch.nn.Module, max_len: int, pad: torch.Tensor | None = None) -> KVCache:
    """A cache for ``model`` (a GPT or Llama) holding up to ``max_len`` positions."""
    limit = model.cfg.max_seq_len
    if max_len > limit:
        raise ValueError(f"a cache of {max_len} positions exceeds model.max_seq_len={limit}")
    return KVCache(len(model.layers), max_len, pad)
