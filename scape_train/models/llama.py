"""Llama style decoder: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied, no biases.

The rotary embedding uses the rotate-half layout of Hugging Face's Llama, so weights move to and
from ``LlamaForCausalLM`` without any q/k permutation.

Parameter names: ``tok_emb.weight``, ``layers.{i}.attn_norm.weight``,
``layers.{i}.attn.{wq,wk,wv,wo}.weight``, ``layers.{i}.mlp_norm.weight``,
``layers.{i}.mlp.{w_gate,w_up,w_down}.weight``, ``norm.weight``, ``lm_head.weight`` (absent when
``tie_embeddings``). ``cfg.bias`` adds biases to every linear except the head. ``forward`` returns
logits over the tokenizer vocab (padded rows sliced off). ``dropout`` applies to attention
probabilities only, matching HF's ``attention_dropout``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scape_train.models.cache import KVCache
from scape_train.models.config import ModelConfig
from scape_train.models.layers import (
    Attention,
    Block,
    CausalLM,
    RMSNorm,
    SwiGLU,
    padded_vocab,
    rope_cos_sin,
)


class Llama(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d = cfg.d_model
        self.head_dim = d // cfg.n_heads
        self.tok_emb = nn.Embedding(padded_vocab(cfg), d)
        self.layers = nn.ModuleList(
            Block(
                RMSNorm(d, cfg.norm_eps),
                Attention(d, cfg.n_heads, cfg.n_kv_heads, cfg.bias, attn_dropout=cfg.dropout),
                RMSNorm(d, cfg.norm_eps),
                SwiGLU(d, cfg.ffn_dim, cfg.bias),
            )
            for _ in range(cfg.n_layers)
        )
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(d, padded_vocab(cfg), bias=False)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; with ``targets`` [B, T], the mean next-token loss instead
        (``models/loss.py``: the training path). With ``cache`` (incremental decoding, ``models/cache.py``) only
        the new tokens are fed; their rotary positions continue from the cache's length."""
        t = self._check_input(input_ids)
        if cache is not None:
            return self._forward_cached(input_ids, cache, t)
        rope = rope_cos_sin(t, self.head_dim, self.cfg.rope_theta, input_ids.device)
        x = self.tok_emb(input_ids)
        for layer in self.layers:
            x = layer(x, rope)
        return self._logits(self.norm(x), targets)

    def _forward_cached(self, input_ids: torch.Tensor, cache: KVCache, t: int) -> torch.Tensor:
        device = input_ids.device
        cache.begin(t, device)
        pos = cache.positions(t, device)                    # [t] or [B, t] (left padding)
        # Rows of the full table: the same values rope_cos_sin(t) gives position by position.
        cos, sin = rope_cos_sin(cache.max_len, self.head_dim, self.cfg.rope_theta, device)
        cos, sin = cos[pos], sin[pos]
        if pos.dim() == 2:                                  # per row: broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        x = self.tok_emb(input_ids)
        for layer, layer_cache in zip(self.layers, cache.layers):
            x = layer(x, (cos, sin), layer_cache)
        cache.end(t)
        return self._logits(self.norm(x))
