"""GPT-2 style decoder: learned positions, LayerNorm, tanh-GeLU MLP, tied embeddings, biases.

Parameter names: ``tok_emb.weight``, ``pos_emb.weight``, ``layers.{i}.attn_norm.{weight,bias}``,
``layers.{i}.attn.{wq,wk,wv,wo}.{weight,bias}``, ``layers.{i}.mlp_norm.*``,
``layers.{i}.mlp.{w_up,w_down}.*``, ``norm.*`` and, only when untied, ``lm_head.weight``.
``forward`` returns logits over the tokenizer vocab (padded embedding rows are sliced off).
Dropout, as in GPT-2, applies to the embeddings, the attention probabilities and both residual
branch outputs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scape_train.models.cache import KVCache
from scape_train.models.config import ModelConfig
from scape_train.models.layers import Attention, Block, CausalLM, GeluMLP, padded_vocab


class GPT(CausalLM):
    EMBEDDINGS = ("tok_emb", "pos_emb")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d = cfg.d_model
        self.tok_emb = nn.Embedding(padded_vocab(cfg), d)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, d)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(
            Block(
                nn.LayerNorm(d, eps=cfg.norm_eps, bias=cfg.bias),
                Attention(d, cfg.n_heads, cfg.n_heads, cfg.bias, cfg.dropout, cfg.dropout),
                nn.LayerNorm(d, eps=cfg.norm_eps, bias=cfg.bias),
                GeluMLP(d, cfg.ffn_dim, cfg.bias, cfg.dropout),
            )
            for _ in range(cfg.n_layers)
        )
        self.norm = nn.LayerNorm(d, eps=cfg.norm_eps, bias=cfg.bias)
        # Tied: the head reads tok_emb.weight directly, so there is one parameter and no tie to
        # re-establish after to_empty() (which would otherwise split a shared Parameter in two).
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(d, padded_vocab(cfg), bias=False)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; with ``targets`` [B, T], the mean next-token loss instead
        (``models/loss.py``: the training path). With ``cache`` (incremental decoding, ``models/cache.py``) only
        the new tokens are fed; positions continue from the cache's length."""
        t = self._check_input(input_ids)
        if cache is not None:
            return self._forward_cached(input_ids, cache, t)
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for layer in self.layers:
            x = layer(x)
        return self._logits(self.norm(x), targets)

    def _forward_cached(self, input_ids: torch.Tensor, cache: KVCache, t: int) -> torch.Tensor:
        cache.begin(t, input_ids.device)
        pos = cache.positions(t, input_ids.device)          # [t] or [B, t] (left padding)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for layer, layer_cache in zip(self.layers, cache.layers):
            x = layer(x, None, layer_cache)
        cache.end(t)
        return self._logits(self.norm(x))
