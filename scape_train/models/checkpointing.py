"""Activation checkpointing policies, applied to a model's blocks from outside the model.

    none        every block keeps what autograd saves (the most memory, no recompute)
    full        a block keeps only its input; its forward runs again in backward
    selective   a block keeps the outputs of its matmuls and of attention, and recomputes the
                elementwise rest (norms, RoPE, activations, residual adds): most of full's saving
                on the [B, T, ffn] tensors at a fraction of its recompute (no GEMM runs twice)

Each block is given a subclass of its own class (once per class and policy, shared by every block,
so a compiled block's code is the same for all of them) whose ``forward`` runs the original one
under ``torch.utils.checkpoint``: parameter names, ``state_dict`` and ``isinstance`` stay as they
were, and ``torch.compile`` sees the checkpoint as one region it can trace (compile outside the
checkpoint, as torchtitan applies them). Inference calls (no grad, or a KV cache) skip it.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

POLICIES = ("none", "selective", "full")            # less memory and more recompute, in order
CHOICES = (*POLICIES, "auto")
# the boolean spellings (YAML true/false, or Hydra's str of a bool) mean full and none
BOOLEANS = {"true": "full", "false": "none"}


def parse_policy(value: object) -> str:
    """``trainer.activation_checkpointing`` as one of CHOICES; true/false mean full/none."""
    text = str(value).strip().lower()
    text = BOOLEANS.get(text, text)
    if text not in CHOICES:
        raise ValueError(
            f"trainer.activation_checkpointing must be none|full|selective|auto (true/false: "
            f"full/none), got {value!r}")
    return text


def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: GEMMs and attention kernels (every
    SDPA backend that exists in this torch), the expensive and the non-elementwise."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The ``context_fn`` of selective checkpointing (a fresh pair of contexts per call)."""
    return create_selective_checkpoint_contexts(_keep_matmuls_and_attention)


class _Recomputed:
    """Mixed in ahead of a block's class: its training forward runs under checkpoint."""

    recompute_context: Callable | None = None        # None: full recompute

    def forward(self, x, rope=None, cache=None):
        plain = super().forward                          # type: ignore[misc]
        if cache is not None or not torch.is_grad_enabled():
            return plain(x, rope, cache)
        kwargs = {} if self.recompute_context is None else {"context_fn": self.recompute_context}
        return checkpoint(plain, x, rope, use_reentrant=False, **kwargs)


@functools.lru_cache(maxsize=None)
def _recomputed_class(cls: type, policy: str) -> type:
    context = staticmethod(selective_context) if policy == "selective" else None
    return type(f"{policy.capitalize()}Recomputed{cls.__name__}", (_Recomputed, cls),
                {"recompute_context": context, "__module__": cls.__module__})


def base_class(block: nn.Module) -> type:
    """The block's own class, under any checkpointing subclass."""
    cls = type(block)
    return cls.__mro__[2] if issubclass(cls, _Recomputed) else cls


def apply_activation_checkpointing(model: nn.Module, policy: str = "full") -> None:
    """Checkpoint every block of ``model.layers`` with ``policy`` (see the module's docstring);
    applying another policy later replaces the first one."""
    policy = parse_policy(policy)
    if policy == "auto":
        raise ValueError("activation checkpointing 'auto' is resolved by the memory plan first "
                         "(plan.check.resolve_checkpointing); apply none|selective|full")
    for block in model.layers:
        cls = base_class(block)
        block.__class__ = cls if policy == "none" else _recomputed_class(cls, policy)


def policy_of(model: nn.Module) -> str:
    """The policy the model's blocks run under."""
    block = model.layers[0]
    if not isinstance(block, _Recomputed):
        return "none"
    return "full" if block.recompute_context is None else "selective"
