"""The model's typed config (Hydra group ``model``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    name: str = "llama_tiny"          # a label for logs; shapes come from the fields below
    arch: str = "llama"               # "llama" | "gpt"
    n_layers: int = 4                 # transformer blocks
    d_model: int = 256                # width (hidden size)
    n_heads: int = 4                  # attention heads; must divide d_model
    n_kv_heads: int = 0               # 0 = n_heads (no grouping); GPT requires n_kv_heads == n_heads
    ffn_dim: int = 0                  # 0 = 4*d_model (GPT) or the Llama rule (8/3 d rounded to 256)
    max_seq_len: int = 256            # GPT: learned position table size; Llama: RoPE cache size
    vocab_size: int = 0               # 0 = follow the tokenizer
    vocab_pad_multiple: int = 1       # pad the embedding rows to a multiple (64 on GPUs); exports trim
    rope_theta: float = 10000.0       # Llama: RoPE base frequency
    norm_eps: float = 1e-5            # epsilon of RMSNorm (Llama) / LayerNorm (GPT)
    tie_embeddings: bool = False      # GPT: true
    bias: bool = False                # GPT: true (linear and LayerNorm biases)
    dropout: float = 0.0              # dropout probability in [0, 1) (0 = off)
    init_std: float = 0.02            # std of the normal weight init
