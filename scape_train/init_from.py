"""Continue pretraining from Hugging Face weights: ``python -m scape_train init_from=hf:<dir|hub id>``.

GPT-2 (``GPT2LMHeadModel``) and Llama (``LlamaForCausalLM``) directories or hub ids, through the
import in ``models/hf.py``.

Which config wins, and why: the MODEL SHAPE AND THE TOKENIZER ARE DERIVED FROM THE WEIGHTS. The
weights fix every shape (layers, width, heads, grouped-query heads, MLP width, vocabulary,
context, tied head, biases, RoPE theta, norm eps), and their embedding rows are indexed by the
ids of the tokenizer they were trained with, so any other value would either not load or silently
mean something else. Restating a dozen fields to match would only add ways to get one wrong. So
``apply_init_from`` replaces the ``model`` group (keeping only ``vocab_pad_multiple``, which adds
never-used rows for aligned matmuls) and ``data.tokenizer`` (kind=hf at the same source), logs
what it replaced, and the resolved ``config.yaml`` of the run records the derived values. Clear
errors, before any work starts:

- a model type or variant the in-tree models cannot represent (``models/hf.py`` says which);
- no tokenizer saved with the weights, or a tokenizer with more tokens than embedding rows;
- ``data.seq_len`` longer than the weights' context (``max_position_embeddings`` / ``n_positions``).

The weights are loaded after the model is built and before a resume; a resumed run (``resume=``
a checkpoint) continues from its checkpoint, not from the HF weights.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

PREFIX = "hf:"
# Any of these beside config.json is a saved tokenizer (fast, GPT-2 BPE, SentencePiece).
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer_config.json")
# Shape fields the weights decide (everything but the label and vocab padding).
_SHAPE_FIELDS = ("arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len",
                 "vocab_size", "tie_embeddings", "bias", "rope_theta", "norm_eps", "dropout")


def resolve_source(source: str) -> str:
    """A local directory (made absolute) or a hub id; a hub id offline fails at once, clearly."""
    if source.startswith(PREFIX):
        source = source[len(PREFIX):]
    if not source:
        raise ValueError("init_from=hf: needs a directory or a hub id after 'hf:'")
    local = Path(source).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{local} has no config.json: give a transformers "
                                    "save_pretrained directory")
        return str(local.resolve())
    if source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{source} does not exist")
    from huggingface_hub import try_to_load_from_cache

    from scape_train.data.hub import require_hub

    if not isinstance(try_to_load_from_cache(source, "config.json"), str):
        require_hub(f"the weights {source!r}", "init_from=hf:<local save_pretrained directory>")
    return source


def tokenizer_config(source: str):
    """``data.tokenizer`` for the tokenizer saved with the weights at ``source``."""
    from scape_train.data.config import TokenizerConfig

    local = Path(source)
    if local.is_dir() and not any((local / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{source} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}). The "
            "tokenizer is taken with the weights, since their embedding rows are indexed by its "
            "ids: save it into the same directory (tokenizer.save_pretrained(dir)).")
    return TokenizerConfig(kind="hf", path=source)


def apply_init_from(cfg: Any) -> Any:
    """A copy of ``cfg`` whose model and tokenizer are those of ``cfg.init_from``; unchanged
    without ``init_from``. Reads config.json and the tokenizer, not the weights."""
    if not cfg.init_from:
        return cfg
    from scape_train.config import ConfigError
    from scape_train.data import build_tokenizer
    from scape_train.models.hf import hf_model_config

    if not cfg.init_from.startswith(PREFIX):
        raise ConfigError(f"init_from must be hf:<dir or hub id>, got {cfg.init_from!r}")
    source = resolve_source(cfg.init_from)
    cfg = copy.deepcopy(cfg)
    derived = hf_model_config(source)
    derived = dataclasses.replace(derived, vocab_pad_multiple=cfg.model.vocab_pad_multiple)
    replaced = {f: (getattr(cfg.model, f), getattr(derived, f)) for f in _SHAPE_FIELDS
                if getattr(cfg.model, f) != getattr(derived, f)}
    if replaced:
        log.info("init_from=%s: the model shape comes from the weights; the model group's %s "
                 "replaced (composed -> weights): %s", cfg.init_from, cfg.model.name,
                 ", ".join(f"{k} {a} -> {b}" for k, (a, b) in replaced.items()))
    cfg.model = derived
    if cfg.data.seq_len > derived.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the context of the weights at "
                          f"{source} ({derived.max_seq_len} positions); lower data.seq_len")
    cfg.data.tokenizer = tokenizer_config(source)
    tokenizer = build_tokenizer(cfg.data)
    if tokenizer.vocab_size > derived.vocab_size:
        raise ConfigError(
            f"init_from: the tokenizer at {source} has {tokenizer.vocab_size} tokens but the weights "
            f"only {derived.vocab_size} embedding rows; ids past the table cannot be embedded. Save "
            "the tokenizer the weights were trained with beside them.")
    return cfg


@torch.no_grad()
def load_init_weights(model: torch.nn.Module, init_from: str) -> None:
    """Copy the weights of ``init_from`` into ``model`` (built from ``apply_init_from``'s config).

    Padded embedding rows (``vocab_pad_multiple``) beyond the weights' vocabulary are zeroed; any
    other difference in names or shapes is an error naming the tensors."""
    from scape_train.models import load_hf

    source = resolve_source(init_from)
    loaded, _ = load_hf(source, device="cpu")
    theirs = loaded.state_dict()
    ours = model.state_dict()
    if set(theirs) != set(ours):
        raise ValueError(f"init_from: the weights at {source} do not match the model's parameters: "
                         f"missing {sorted(set(ours) - set(theirs))[:5]}, unexpected "
                         f"{sorted(set(theirs) - set(ours))[:5]}")
    for name, dst in ours.items():
        src = theirs[name]
        if src.shape == dst.shape:
            dst.copy_(src)
        elif name in ("tok_emb.weight", "lm_head.weight") and src.shape[1:] == dst.shape[1:] \
                and src.shape[0] < dst.shape[0]:
            dst.zero_()
            dst[: src.shape[0]].copy_(src)
        else:
            raise ValueError(f"init_from: {name} has shape {tuple(src.shape)} in {source} but "
                             f"{tuple(dst.shape)} in the model")
    log.info("initialized %d tensors from %s", len(ours), source)
