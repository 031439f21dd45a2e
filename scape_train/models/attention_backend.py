"""``trainer.attention_backend``: which scaled-dot-product-attention kernel the trainer tries first.

    auto        torch's own order (flash, memory-efficient, math; cuDNN last, so never on CUDA)
    cudnn       cuDNN's fused attention first (on Hopper, the kernel to try against FlashAttention-2)
    flash       FlashAttention-2 first
    efficient   the memory-efficient kernel first
    math        the unfused reference (for debugging: it materialises B x H x T x T)

A fused kernel is a priority, not a demand: every other backend follows it, so a shape the first
one cannot take (an attention mask, a head size) falls through to the next instead of failing;
``math`` alone is exclusive. The order is set around the training loop (``Trainer.fit``), where
the blocks compile: inductor picks the kernel when it traces, from the order in force then. Off
CUDA torch does not consult the priority (its CPU path takes its flash kernel where it can), so
there only ``math`` changes the kernel.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

CHOICES = ("auto", "cudnn", "flash", "efficient", "math")


def parse_attention_backend(value: object) -> str:
    text = str(value).strip().lower()
    if text not in CHOICES:
        raise ValueError(f"trainer.attention_backend must be auto|cudnn|flash|efficient|math "
                         f"(the SDPA kernel tried first), got {value!r}")
    return text


def priority(name: str) -> list:
    """The SDPA backends ``name`` allows, in its order: it first, then torch's default order
    (``math``: math alone)."""
    from torch.nn.attention import SDPBackend

    if name == "math":
        return [SDPBackend.MATH]
    default = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
               SDPBackend.CUDNN_ATTENTION]
    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    return [first] + [b for b in default if b != first]


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Run the block with ``name``'s priority order (``auto``: unchanged); restored after."""
    name = parse_attention_backend(name)
    if name == "auto":
        yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(priority(name), set_priority=True):
        yield


def chosen_kernel(n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int,
                  device: torch.device, dtype: torch.dtype) -> str:
    """The kernel SDPA picks now for the model's causal training attention (a one-row probe of
    its shapes, no compute): what the trainer logs, so a run says which one it trained with."""
    from torch.nn.attention import SDPBackend

    # requiring grad, as in training: some kernels take a shape forward-only
    q = torch.empty(1, n_heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
    kv = torch.empty(1, n_kv_heads, seq_len, head_dim, device=device, dtype=dtype,
                     requires_grad=True)
    choice = torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=n_kv_heads != n_heads)
    return SDPBackend(choice).name.lower()
