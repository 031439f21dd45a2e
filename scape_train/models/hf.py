"""Export to and import from Hugging Face ``transformers`` (GPT2LMHeadModel, LlamaForCausalLM).

Export writes a ``save_pretrained`` directory (config.json, model.safetensors, and the tokenizer
beside it when one is given). Padded vocab rows are trimmed, so the HF model has exactly the
tokenizer's vocab. Import maps the weights back; the imported model has ``vocab_pad_multiple=1``
and, for GPT-2, ``bias=True`` (HF's GPT-2 always has biases; a ``bias=False`` model is exported
with zero biases, so its logits are unchanged).

Wrappers applied from outside (torch.compile, activation checkpointing) are stripped from the
names. A sharded model (FSDP2 DTensors) is gathered with ``full_tensor()``, a collective: every
rank must then call ``export_hf`` (give each rank its own ``out_dir``; keep rank 0's).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from scape_train.models.config import ModelConfig

# Per-layer renames (ours -> HF), below "layers.{i}." and "model.layers.{i}." respectively.
_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "mlp.w_gate": "mlp.gate_proj",
    "mlp.w_up": "mlp.up_proj",
    "mlp.w_down": "mlp.down_proj",
}
# Wrappers applied from outside (torch.compile, activation checkpointing) insert these into names.
_WRAPPER_PARTS = re.compile(r"(_orig_mod\.|_checkpoint_wrapped_module\.|_fsdp_wrapped_module\.)")
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # both are the tanh approximation our GPT uses


def _plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):  # DTensor from FSDP2/TP
            t = t.full_tensor()
        out[_WRAPPER_PARTS.sub("", name)] = t.detach().to("cpu")
    return out


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "_orig_mod"):
        model = model._orig_mod  # type: ignore[assignment]
    return model


# ---------------------------------------------------------------------------------------------
# ours -> HF


def _llama_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    v = cfg.vocab_size
    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"][:v],
        "model.norm.weight": sd["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"][:v]
    for i in range(cfg.n_layers):
        for key, t in sd.items():
            prefix = f"layers.{i}."
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            stem, _, leaf = rest.rpartition(".")
            hf = _LLAMA_LAYER.get(rest) or f"{_LLAMA_LAYER[stem]}.{leaf}"
            out[f"model.layers.{i}.{hf}"] = t
    return out


def _gpt_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    def bias(key: str, n: int) -> torch.Tensor:
        # HF GPT-2 always has biases: a bias-free model exports zeros (same function).
        return sd[key] if key in sd else torch.zeros(n, dtype=sd["tok_emb.weight"].dtype)

    d, v, f = cfg.d_model, cfg.vocab_size, cfg.ffn_dim
    out = {
        "transformer.wte.weight": sd["tok_emb.weight"][:v],
        "transformer.wpe.weight": sd["pos_emb.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": bias("norm.bias", d),
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"][:v]
    for i in range(cfg.n_layers):
        o, h = f"layers.{i}.", f"transformer.h.{i}."
        # HF's Conv1D stores weights as [in, out]: transpose every linear; q, k, v are fused.
        qkv = [sd[f"{o}attn.{n}.weight"] for n in ("wq", "wk", "wv")]
        out[f"{h}attn.c_attn.weight"] = torch.cat(qkv, 0).t().contiguous()
        qkv_bias = [bias(f"{o}attn.{n}.bias", d) for n in ("wq", "wk", "wv")]
        out[f"{h}attn.c_attn.bias"] = torch.cat(qkv_bias)
        out[f"{h}attn.c_proj.weight"] = sd[f"{o}attn.wo.weight"].t().contiguous()
        out[f"{h}attn.c_proj.bias"] = bias(f"{o}attn.wo.bias", d)
        out[f"{h}mlp.c_fc.weight"] = sd[f"{o}mlp.w_up.weight"].t().contiguous()
        out[f"{h}mlp.c_fc.bias"] = bias(f"{o}mlp.w_up.bias", f)
        out[f"{h}mlp.c_proj.weight"] = sd[f"{o}mlp.w_down.weight"].t().contiguous()
        out[f"{h}mlp.c_proj.bias"] = bias(f"{o}mlp.w_down.bias", d)
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[f"{h}{theirs}.weight"] = sd[f"{o}{ours}.weight"]
            out[f"{h}{theirs}.bias"] = bias(f"{o}{ours}.bias", d)
    return out


def _hf_config(cfg: ModelConfig, tokenizer: Any) -> Any:
    from transformers import GPT2Config, LlamaConfig

    tokens = {
        "bos_token_id": getattr(tokenizer, "bos_token_id", None),
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "pad_token_id": getattr(tokenizer, "pad_token_id", None),
    }
    if cfg.arch == "llama":
        return LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads,
            head_dim=cfg.d_model // cfg.n_heads,
            hidden_act="silu",
            max_position_embeddings=cfg.max_seq_len,
            initializer_range=cfg.init_std,
            rms_norm_eps=cfg.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
            tie_word_embeddings=cfg.tie_embeddings,
            attention_bias=cfg.bias,
            mlp_bias=cfg.bias,
            attention_dropout=cfg.dropout,
            **tokens,
        )
    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=cfg.ffn_dim,
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.norm_eps,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        **tokens,
    )


def export_hf(model: nn.Module, out_dir: str | Path, tokenizer: Any = None) -> Path:
    """Write ``model`` as a transformers ``save_pretrained`` directory and return its path.

    GPT -> ``GPT2LMHeadModel``, Llama -> ``LlamaForCausalLM``; weights keep their dtype. When
    ``tokenizer`` has ``save_pretrained`` it is saved beside the weights, and its bos/eos/pad ids
    go into the config.
    """
    from transformers import AutoModelForCausalLM

    cfg: ModelConfig = _unwrap(model).cfg  # type: ignore[assignment]
    if tokenizer is not None and hasattr(tokenizer, "__len__") and len(tokenizer) > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model only {cfg.vocab_size}: "
            "export the tokenizer the model was trained with"
        )
    sd = _plain_state_dict(model)
    hf_sd = _llama_to_hf(sd, cfg) if cfg.arch == "llama" else _gpt_to_hf(sd, cfg)
    hf_config = _hf_config(cfg, tokenizer)

    # Build the HF module without allocating, then adopt our tensors: strict loading checks that
    # every HF weight is produced exactly once, with the right shape.
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    if cfg.tie_embeddings:
        embed = "model.embed_tokens.weight" if cfg.arch == "llama" else "transformer.wte.weight"
        hf_sd["lm_head.weight"] = hf_sd[embed]
    # Slices of padded tables are views; safetensors needs each tensor to own its storage.
    hf_sd = {k: t.clone().contiguous() for k, t in hf_sd.items()}
    hf_model.load_state_dict(hf_sd, strict=True, assign=True)
    if cfg.tie_embeddings:
        hf_model.tie_weights()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(out)
    if tokenizer is not None:
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(out)
        else:
            warnings.warn(
                f"tokenizer of type {type(tokenizer).__name__} has no save_pretrained(); "
                f"only the model was written to {out}",
                stacklevel=2,
            )
    return out


# ---------------------------------------------------------------------------------------------
# HF -> ours


def _config_from_hf(hf_cfg: Any, name: str) -> ModelConfig:
    if hf_cfg.model_type == "llama":
        rope = hf_cfg.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported; only 'default'")
        if hf_cfg.hidden_act != "silu":
            raise ValueError(f"Llama hidden_act {hf_cfg.hidden_act!r} is unsupported; only 'silu'")
        if hf_cfg.head_dim != hf_cfg.hidden_size // hf_cfg.num_attention_heads:
            raise ValueError(
                f"head_dim={hf_cfg.head_dim} differs from hidden_size / num_attention_heads; "
                "the in-tree Llama derives head_dim from d_model"
            )
        if bool(hf_cfg.attention_bias) != bool(hf_cfg.mlp_bias):
            raise ValueError("attention_bias and mlp_bias differ; the in-tree Llama has one `bias`")
        return ModelConfig(
            name=name,
            arch="llama",
            n_layers=hf_cfg.num_hidden_layers,
            d_model=hf_cfg.hidden_size,
            n_heads=hf_cfg.num_attention_heads,
            n_kv_heads=hf_cfg.num_key_value_heads,
            ffn_dim=hf_cfg.intermediate_size,
            max_seq_len=hf_cfg.max_position_embeddings,
            vocab_size=hf_cfg.vocab_size,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            norm_eps=hf_cfg.rms_norm_eps,
            tie_embeddings=bool(hf_cfg.tie_word_embeddings),
            bias=bool(hf_cfg.attention_bias),
            dropout=float(hf_cfg.attention_dropout),
            init_std=hf_cfg.initializer_range,
        )
    if hf_cfg.model_type == "gpt2":
        if hf_cfg.activation_function not in _GELU_TANH:
            raise ValueError(
                f"GPT-2 activation {hf_cfg.activation_function!r} is not supported; the in-tree "
                f"GPT uses the tanh GeLU ({' / '.join(_GELU_TANH)})"
            )
        if not hf_cfg.scale_attn_weights or hf_cfg.scale_attn_by_inverse_layer_idx:
            raise ValueError("only standard 1/sqrt(head_dim) attention scaling is supported")
        return ModelConfig(
            name=name,
            arch="gpt",
            n_layers=hf_cfg.n_layer,
            d_model=hf_cfg.n_embd,
            n_heads=hf_cfg.n_head,
            n_kv_heads=hf_cfg.n_head,
            ffn_dim=hf_cfg.n_inner or 4 * hf_cfg.n_embd,
            max_seq_len=hf_cfg.n_positions,
            vocab_size=hf_cfg.vocab_size,
            norm_eps=hf_cfg.layer_norm_epsilon,
            tie_embeddings=bool(hf_cfg.tie_word_embeddings),
            bias=True,
            dropout=float(hf_cfg.resid_pdrop),
            init_std=hf_cfg.initializer_range,
        )
    raise ValueError(f"model_type {hf_cfg.model_type!r} is not supported; use 'llama' or 'gpt2'")


def _llama_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    ours = {
        "tok_emb.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if not cfg.tie_embeddings:
        ours["lm_head.weight"] = hf["lm_head.weight"]
    back = {v: k for k, v in _LLAMA_LAYER.items()}
    pattern = re.compile(r"model\.layers\.(\d+)\.(.+)")
    for key, t in hf.items():
        m = pattern.fullmatch(key)
        if m is None:
            continue
        rest = m.group(2)
        stem, _, leaf = rest.rpartition(".")
        name = back.get(rest) or f"{back[stem]}.{leaf}"
        ours[f"layers.{m.group(1)}.{name}"] = t
    return ours


def _gpt_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    d = cfg.d_model
    ours = {
        "tok_emb.weight": hf["transformer.wte.weight"],
        "pos_emb.weight": hf["transformer.wpe.weight"],
        "norm.weight": hf["transformer.ln_f.weight"],
        "norm.bias": hf["transformer.ln_f.bias"],
    }
    if not cfg.tie_embeddings:
        ours["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.n_layers):
        o, h = f"layers.{i}.", f"transformer.h.{i}."
        w = hf[f"{h}attn.c_attn.weight"].t()
        b = hf[f"{h}attn.c_attn.bias"]
        for j, n in enumerate(("wq", "wk", "wv")):
            ours[f"{o}attn.{n}.weight"] = w[j * d : (j + 1) * d]
            ours[f"{o}attn.{n}.bias"] = b[j * d : (j + 1) * d]
        ours[f"{o}attn.wo.weight"] = hf[f"{h}attn.c_proj.weight"].t()
        ours[f"{o}attn.wo.bias"] = hf[f"{h}attn.c_proj.bias"]
        ours[f"{o}mlp.w_up.weight"] = hf[f"{h}mlp.c_fc.weight"].t()
        ours[f"{o}mlp.w_up.bias"] = hf[f"{h}mlp.c_fc.bias"]
        ours[f"{o}mlp.w_down.weight"] = hf[f"{h}mlp.c_proj.weight"].t()
        ours[f"{o}mlp.w_down.bias"] = hf[f"{h}mlp.c_proj.bias"]
        for mine, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            ours[f"{o}{mine}.weight"] = hf[f"{h}{theirs}.weight"]
            ours[f"{o}{mine}.bias"] = hf[f"{h}{theirs}.bias"]
    return ours


def hf_model_config(path: str | Path) -> ModelConfig:
    """The in-tree ModelConfig of a GPT-2 / Llama ``save_pretrained`` directory (or hub id), from
    its config.json alone (no weights read); unsupported variants raise ValueError."""
    from transformers import AutoConfig

    return _config_from_hf(AutoConfig.from_pretrained(str(path)), name=Path(str(path)).name)


def load_hf(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, ModelConfig]:
    """Load a GPT-2 or Llama ``save_pretrained`` directory into the in-tree model (fp32).

    Returns ``(model, cfg)``; ``cfg`` is fully resolved (``vocab_pad_multiple=1``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from scape_train.models.build import build_model

    path = Path(path)
    cfg = _config_from_hf(AutoConfig.from_pretrained(path), name=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf_sd = hf_model.state_dict()
    ours = _llama_from_hf(hf_sd, cfg) if cfg.arch == "llama" else _gpt_from_hf(hf_sd, cfg)
    del hf_model
    # Allocate without a random init: strict loading overwrites every parameter (no buffers).
    model = build_model(cfg, device="meta").to_empty(device=device)
    model.load_state_dict(ours, strict=True)
    return model, model.cfg
