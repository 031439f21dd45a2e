"""What the trainer applies to a built model, from outside it: checkpointing, compile, the loss.

The order is torchtitan's: checkpoint-wrap each block, then compile each block (the compiled
region holds the checkpoint, so Dynamo traces it as one region and its recompute runs inside the
compiled backward), one block at a time rather than the whole model: the blocks share one class
and one code object, so the compile happens once for all of them. The head and the loss stay
outside the blocks; under compile the loss's per-chunk function is compiled too.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from scape_train.models.checkpointing import apply_activation_checkpointing
from scape_train.models.loss import chunk_loss_and_grad

log = logging.getLogger("scape_train")

COMPILE_CHOICES = ("auto", "true", "false")


def parse_compile(value: object) -> str:
    """``trainer.compile`` as auto|true|false (a YAML bool arrives as Hydra's "True"/"False")."""
    text = str(value).strip().lower()
    if text not in COMPILE_CHOICES:
        raise ValueError(f"trainer.compile must be auto|true|false (auto: on CUDA only), got {value!r}")
    return text


def compile_enabled(value: object, device: torch.device | str) -> bool:
    """auto compiles on CUDA only: on a CPU the first step's compile costs more than it saves."""
    mode = parse_compile(value)
    return mode == "true" or (mode == "auto" and torch.device(device).type == "cuda")


def keep_one_graph_per_recompute() -> None:
    """Dynamo checks a frame's compiled graphs most-recently-used first; a recompute that enters a
    compiled frame again (an eager checkpoint around compiled code, as a graph break inside a
    block makes) could then run another graph than its forward did (other shapes or strides: a
    CheckpointError). Checking them in creation order keeps the forward's. With the checkpoint
    inside the compiled block the recompute runs in the compiled backward and enters no frame;
    this keeps a graph break from reopening that failure. Absent before torch 2.10: skipped."""
    set_lru = getattr(torch._C._dynamo.eval_frame, "_set_lru_cache", None)
    if set_lru is not None:
        set_lru(False)


def prepare_for_training(model: nn.Module, checkpointing: str, compile: bool,
                         loss_chunk_tokens: int) -> None:
    """Apply a resolved checkpointing policy (none|selective|full|full_every_N), compile when
    asked, and set the loss's chunk size (0 = the full logits), in place: parameter names do
    not change."""
    apply_activation_checkpointing(model, checkpointing)
    model.loss_chunk_tokens = loss_chunk_tokens
    model.loss_chunk_fn = chunk_loss_and_grad
    if not compile:
        return
    if checkpointing != "none":
        keep_one_graph_per_recompute()
    for block in model.layers:
        block.compile()
    model.loss_chunk_fn = torch.compile(chunk_loss_and_grad)
    log.info("compiled %d blocks and the loss (activation checkpointing: %s)",
             len(model.layers), checkpointing)
