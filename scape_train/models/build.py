"""Turn a ModelConfig into a model: resolve defaults, validate, build on meta, materialize."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from scape_train.models.config import ModelConfig
from scape_train.models.gpt import GPT
from scape_train.models.layers import CausalLM
from scape_train.models.llama import Llama

ARCHS: dict[str, type[CausalLM]] = {"llama": Llama, "gpt": GPT}


def llama_ffn_dim(d_model: int, multiple: int = 256) -> int:
    """Llama's SwiGLU width: 8/3 * d_model (same FLOPs as a 4x GeLU MLP), rounded up to 256."""
    return multiple * math.ceil(int(8 * d_model / 3) / multiple)


def _as_model_config(cfg: Any) -> ModelConfig:
    if isinstance(cfg, ModelConfig):
        return cfg
    # A Hydra/OmegaConf node (structured or plain) of the `model` group.
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    raise TypeError(f"expected a ModelConfig or an OmegaConf DictConfig, got {type(cfg).__name__}")


def resolve_config(cfg: ModelConfig | Any, vocab_size: int | None = None) -> ModelConfig:
    """Validate ``cfg`` and return a copy with every 0-means-default field made explicit.

    ``vocab_size`` (the tokenizer's) fills ``cfg.vocab_size == 0``; when the config fixes a vocab,
    a larger tokenizer is an error because its ids would index past the embedding.
    """
    cfg = _as_model_config(cfg)
    if cfg.arch not in ARCHS:
        raise ValueError(f"model.arch={cfg.arch!r} is unknown; use one of {sorted(ARCHS)}")
    for field in ("n_layers", "d_model", "n_heads", "max_seq_len", "vocab_pad_multiple"):
        if getattr(cfg, field) <= 0:
            raise ValueError(f"model.{field} must be positive, got {getattr(cfg, field)}")
    for field in ("n_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(cfg, field) < 0:
            raise ValueError(f"model.{field} must be >= 0 (0 = default), got {getattr(cfg, field)}")
    for field in ("init_std", "norm_eps", "rope_theta"):
        if not getattr(cfg, field) > 0:
            raise ValueError(f"model.{field} must be > 0, got {getattr(cfg, field)}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"model.dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.d_model % cfg.n_heads:
        raise ValueError(
            f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}; "
            "choose n_heads so that head_dim = d_model / n_heads is an integer"
        )
    n_kv = cfg.n_kv_heads or cfg.n_heads
    if cfg.n_heads % n_kv:
        raise ValueError(
            f"model.n_heads={cfg.n_heads} is not divisible by model.n_kv_heads={n_kv}; "
            "each key/value head must serve a whole group of query heads"
        )
    if cfg.arch == "gpt" and n_kv != cfg.n_heads:
        raise ValueError(
            f"GPT has no grouped-query attention: set model.n_kv_heads to 0 or {cfg.n_heads}, "
            f"got {cfg.n_kv_heads}"
        )
    if cfg.arch == "llama" and (cfg.d_model // cfg.n_heads) % 2:
        raise ValueError(
            f"RoPE needs an even head_dim; d_model / n_heads = {cfg.d_model // cfg.n_heads}"
        )

    if cfg.vocab_size == 0:
        if vocab_size is None or vocab_size <= 0:
            raise ValueError(
                "model.vocab_size is 0 (follow the tokenizer) but no tokenizer vocab size was "
                "given: pass vocab_size=len(tokenizer) to build_model or set model.vocab_size"
            )
        vocab = vocab_size
    else:
        if vocab_size is not None and vocab_size > cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab_size} tokens but model.vocab_size={cfg.vocab_size}; "
                "set model.vocab_size=0 to follow the tokenizer"
            )
        vocab = cfg.vocab_size

    ffn = cfg.ffn_dim or (4 * cfg.d_model if cfg.arch == "gpt" else llama_ffn_dim(cfg.d_model))
    return dataclasses.replace(cfg, vocab_size=vocab, n_kv_heads=n_kv, ffn_dim=ffn)


def build_model(
    cfg: ModelConfig | Any, vocab_size: int | None = None, device: str | torch.device = "cpu"
) -> CausalLM:
    """Build the model described by ``cfg``.

    The modules are created on the meta device (no memory); with ``device="meta"`` that is all,
    which is enough for counting parameters and FLOPs. Otherwise the storage is allocated on
    ``device`` and ``init_weights()`` draws the values from the current torch RNG.
    """
    cfg = resolve_config(cfg, vocab_size)
    with torch.device("meta"):
        model = ARCHS[cfg.arch](cfg)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model
