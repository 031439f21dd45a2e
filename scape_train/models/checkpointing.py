"""Activation checkpointing policies, applied to a model's blocks from outside the model.

    none        every block keeps what autograd saves (the most memory, no recompute)
    full        a block keeps only its input; its forward runs again in backward
    selective   a block keeps the outputs of its matmuls and of attention, and recomputes the
                elementwise rest (norms, RoPE, activations, residual adds): most of full's saving
                on the [B, T, ffn] tensors at a fraction of its recompute (no GEMM runs twice)
    full_every_N  blocks 0, N, 2N, ... full, the others selective: between the two in memory and
                recompute (1/N of the forward runs again). Keeping the others whole (none) instead,
                as layer-wise schemes do, would keep more than selective and recompute more too.

``auto`` walks LADDER (the least recompute first) and takes the first policy the memory plan fits.

Each block is given a subclass of its own class (once per class and policy, shared by every block,
so a compiled block's code is the same for all of them) whose ``forward`` runs the original one
under ``torch.utils.checkpoint``: parameter names, ``state_dict`` and ``isinstance`` stay as they
were, and ``torch.compile`` sees the checkpoint as one region it can trace (compile outside the
checkpoint, as torchtitan applies them). Inference calls (no grad, or a KV cache) skip it.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

BLOCK_POLICIES = ("none", "selective", "full")      # what one block runs under
# less memory and more recompute, in order: what auto and the plan's fixes try
LADDER = ("none", "selective", "full_every_4", "full_every_2", "full")
# the boolean spellings (YAML true/false, or Hydra's str of a bool) mean full and none
BOOLEANS = {"true": "full", "false": "none"}
_EVERY = re.compile(r"full_every_(\d+)")


def parse_policy(value: object) -> str:
    """``trainer.activation_checkpointing`` as none|selective|full|full_every_N (N >= 2)|auto;
    true/false mean full/none."""
    text = str(value).strip().lower()
    text = BOOLEANS.get(text, text)
    every = _EVERY.fullmatch(text)
    if text in (*BLOCK_POLICIES, "auto") or (every and int(every[1]) >= 2):
        return f"full_every_{int(every[1])}" if every else text
    raise ValueError(
        f"trainer.activation_checkpointing must be none|selective|full|full_every_N (N >= 2: "
        f"every N-th block full, the others selective)|auto (true/false: full/none), got {value!r}")


def block_policies(policy: str, n_layers: int) -> list[str]:
    """The policy of each of ``n_layers`` blocks under a resolved model-wide policy."""
    every = _EVERY.fullmatch(policy)
    if every is None:
        return [policy] * n_layers
    return ["full" if i % int(every[1]) == 0 else "selective" for i in range(n_layers)]


def recompute_order(policy: str) -> float:
    """Where ``policy`` sits between none (0) and full (2): selective 1, full_every_N 1 + 1/N."""
    every = _EVERY.fullmatch(policy)
    return 1 + 1 / int(every[1]) if every else float(BLOCK_POLICIES.index(policy))


def stronger_than(policy: str) -> list[str]:
    """The LADDER's policies that keep less than ``policy`` (auto: all but none), in order."""
    if policy == "auto":
        return list(LADDER[1:])
    return [p for p in LADDER if recompute_order(p) > recompute_order(policy)]


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
    """Checkpoint the blocks of ``model.layers`` with ``policy`` (see the module's docstring);
    applying another policy later replaces the first one."""
    policy = parse_policy(policy)
    if policy == "auto":
        raise ValueError("activation checkpointing 'auto' is resolved by the memory plan first "
                         "(plan.check.resolve_checkpointing); apply none|selective|full|full_every_N")
    for block, each in zip(model.layers, block_policies(policy, len(model.layers))):
        cls = base_class(block)
        block.__class__ = cls if each == "none" else _recomputed_class(cls, each)


def _block_policy(block: nn.Module) -> str:
    if not isinstance(block, _Recomputed):
        return "none"
    return "full" if block.recompute_context is None else "selective"


def policy_of(model: nn.Module) -> str:
    """The policy the model's blocks run under (full_every_N: the smallest N that describes it)."""
    found = [_block_policy(b) for b in model.layers]
    if len(set(found)) == 1:
        return found[0]
    for n in range(2, len(found) + 1):
        if block_policies(f"full_every_{n}", len(found)) == found:
            return f"full_every_{n}"
    raise ValueError(f"the blocks run under no one policy: {found}")
