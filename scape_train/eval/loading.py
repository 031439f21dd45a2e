"""Rebuild a trained model and its tokenizer from a checkpoint (or run) directory, with checks.

A checkpoint directory holds ``manifest.json`` (checksums, ``meta.model``, ``meta.data``,
``meta.tokenizer_fingerprint``) and ``model.pt``; a run directory holds ``checkpoints/step_*``
and ``tokenizer/`` (the tokenizer the run trained with). Everything is verified before use: the
checksums, the tokenizer's fingerprint, and that the state dict fits the rebuilt model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from scape_train.checkpoint import MODEL_FILE, CheckpointError, CheckpointManager, find_checkpoint


def _dataclass_from(cls: type, values: dict[str, Any], what: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise CheckpointError(f"the checkpoint's {what} has fields this version does not know: "
                              f"{unknown}; evaluate it with the scape_train version that wrote it")
    return cls(**values)


def load_tokenizer(ckpt: Path, meta: dict[str, Any]):
    """The run's saved tokenizer (``<run_dir>/tokenizer``) if present, else ``meta.data``'s."""
    from scape_train.data import build_tokenizer
    from scape_train.data.config import DataConfig, TokenizerConfig

    saved = ckpt.parent.parent / "tokenizer"
    if saved.is_dir():
        data = DataConfig(tokenizer=TokenizerConfig(kind="hf", path=str(saved)))
        source = str(saved)
    else:
        raw = dict(meta.get("data") or {})
        tok = _dataclass_from(TokenizerConfig, dict(raw.pop("tokenizer", {}) or {}), "data.tokenizer")
        data = _dataclass_from(DataConfig, {**raw, "tokenizer": tok}, "data config")
        source = f"data.tokenizer (kind={tok.kind}, path={tok.path})"
    tokenizer = build_tokenizer(data)
    expected = meta.get("tokenizer_fingerprint")
    if expected and tokenizer.fingerprint != expected:
        raise CheckpointError(
            f"{ckpt} was trained with another tokenizer: the one from {source} has fingerprint "
            f"{tokenizer.fingerprint}, the checkpoint expects {expected}. Evaluate with the run's "
            "own tokenizer/ directory or the data.tokenizer settings it trained with.")
    return tokenizer


def build_checked_model(model_cfg: Any, state: dict[str, torch.Tensor], vocab_size: int,
                        device: torch.device, where: str) -> torch.nn.Module:
    """``model_cfg``'s model with ``state`` loaded strictly; a mismatch says what differs."""
    from scape_train.models import build_model

    model = build_model(model_cfg, vocab_size=vocab_size, device="meta").to_empty(device=device)
    ours = model.state_dict()
    missing = sorted(set(ours) - set(state))
    unexpected = sorted(set(state) - set(ours))
    shapes = {k: (tuple(state[k].shape), tuple(ours[k].shape)) for k in set(ours) & set(state)
              if tuple(state[k].shape) != tuple(ours[k].shape)}
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if shapes:
            some = dict(sorted(shapes.items())[:5])
            parts.append(f"shape (saved vs model) {some}")
        raise CheckpointError(f"{where}: the weights do not fit the model config "
                              f"{getattr(model_cfg, 'name', '')!r}: " + "; ".join(parts))
    model.load_state_dict(state, strict=True)
    model.eval()
    return model


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu"):
    """(model, tokenizer, checkpoint dir, manifest) from a checkpoint or run directory."""
    from scape_train.models.config import ModelConfig

    ckpt = find_checkpoint(path)
    manifest = CheckpointManager.verify(ckpt)
    meta = manifest.get("meta") or {}
    if "model" not in meta:
        raise CheckpointError(f"{ckpt}/manifest.json has no meta.model; cannot rebuild the model")
    model_cfg = _dataclass_from(ModelConfig, dict(meta["model"]), "model config")
    tokenizer = load_tokenizer(ckpt, meta)
    state = torch.load(ckpt / MODEL_FILE, map_location="cpu", weights_only=True)
    model = build_checked_model(model_cfg, state, tokenizer.vocab_size, torch.device(device), str(ckpt))
    return model, tokenizer, ckpt, manifest
