"""Trace one training micro-batch (forward, loss, backward) on fake tensors and measure its memory.

The model is the trainer's own (``build_model``, checkpointing policy and loss chunking applied by
the trainer's ``models.training.prepare_for_training``), built under ``FakeTensorMode``: every tensor has its real shape,
dtype and storage size but no data, so a Llama-500M micro-batch of 16 x 4096 tokens costs about a
second of CPU. The loss is the trainer's: ``model(tokens, targets=targets) / accum`` (the model
masks its padded vocab and upcasts to fp32, ``models/loss.py``) under the trainer's autocast. With
gradient accumulation two micro-batches are traced, because the second runs with the gradients
already allocated.

Attention: the trace runs on CPU fake tensors, where SDPA picks its CPU flash kernel -- O(T) memory,
saving q, k, v, the output and the log-sum-exp, as the CUDA flash / memory-efficient kernels do.
The one GPU case where CUDA falls back to the math kernel (materialising B x H x T x T scores) is
fp32 with grouped-query attention (CUDA's flash kernel needs fp16/bf16, its memory-efficient kernel
has no GQA); the trace forces the math kernel there. Dropout > 0 takes the CPU math kernel too, an
over-estimate on GPUs (no shipped model uses dropout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch

from scape_train.models.config import ModelConfig
from scape_train.plan.tracker import CUDA_BLOCK, LiveBytes


@dataclass(frozen=True)
class MicroBatchTrace:
    """Bytes, per device. ``peak_*`` break down the forward/backward peak."""

    params: int                 # parameters (the model's dtype, fp32)
    grads: int                  # parameter gradients once backward is done
    peak: int                   # peak live bytes over the traced micro-batches (params included)
    peak_grads: int             # gradients alive at that peak
    peak_activations: int       # tensors created by the forward up to the final norm (saved ones)
    peak_logits: int            # logits, their fp32 copy and the loss internals
    peak_backward: int          # backward temporaries (activation gradients), besides ``peak_grads``
    held_after: int             # what the trainer still references after backward
    ops: int                    # aten ops traced (a cost figure)


def math_attention(model_cfg: ModelConfig, on_gpu: bool, bf16: bool,
                   attention_backend: str = "auto") -> bool:
    """Does the GPU's attention run the unfused math kernel (B x H x T x T scores)? When asked
    for (trainer.attention_backend=math), or in fp32 with grouped K/V heads, which no fused GPU
    kernel takes."""
    gqa = (model_cfg.n_kv_heads or model_cfg.n_heads) != model_cfg.n_heads
    return on_gpu and (attention_backend == "math" or (not bf16 and gqa))


def trace_micro_batch(model_cfg: ModelConfig, vocab_size: int, micro_batch: int, seq_len: int, *,
                      bf16: bool, activation_checkpointing: str | bool, accum: int = 1,
                      on_gpu: bool = False, loss_chunk_tokens: int = 0,
                      attention_backend: str = "auto") -> MicroBatchTrace:
    """Trace ``min(accum, 2)`` micro-batches of ``micro_batch x seq_len`` tokens as the trainer runs
    them, with the checkpointing policy (none|selective|full|full_every_N; a bool: full or
    none), the loss's chunk size and the attention kernel the trainer applies. A pure function of
    its arguments, so it is memoised (experiments that differ only in the optimizer share one trace)."""
    from scape_train.models.checkpointing import parse_policy

    return _trace(tuple(dataclasses.astuple(model_cfg)), vocab_size, micro_batch, seq_len, bf16,
                  parse_policy(activation_checkpointing), min(accum, 2), on_gpu, loss_chunk_tokens,
                  math_attention(model_cfg, on_gpu, bf16, attention_backend))


@functools.lru_cache(maxsize=32)
def _trace(model_fields: tuple, vocab_size: int, micro_batch: int, seq_len: int, bf16: bool,
           policy: str, accum: int, on_gpu: bool, loss_chunk_tokens: int,
           math: bool) -> MicroBatchTrace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scape_train.models.build import ARCHS, resolve_config
    from scape_train.models.training import prepare_for_training

    model_cfg = ModelConfig(*model_fields)
    tracker = LiveBytes(round_to=CUDA_BLOCK if on_gpu else 1)
    attention = contextlib.nullcontext()
    if math:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    resolved = resolve_config(model_cfg, vocab_size)
    with FakeTensorMode():
        # Constructed in place under the fake mode (build_model's meta-then-to_empty would have to
        # swap the fake tensors into Parameters); the initialisation runs on fake storage, for free.
        with torch.device("cpu"):
            model = ARCHS[resolved.arch](resolved)
        model.train()
        prepare_for_training(model, policy, compile=False, loss_chunk_tokens=loss_chunk_tokens)
        params = [p for p in model.parameters() if p.requires_grad]
        tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        targets = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        tracker.track(params, "params")
        tracker.track([tokens, targets], "activations")

        def body_done(module, args, output):   # the final norm: what follows is logits and loss
            tracker.category = "logits"

        hook = model.norm.register_forward_hook(body_done)
        with tracker, attention:
            for _ in range(min(accum, 2)):
                tracker.category = "activations"
                with autocast():
                    loss = model(tokens, targets=targets) / accum
                tracker.category = "backward"
                loss.backward()
                del loss
        hook.remove()
        # by storage: autograd may hand several parameters views of one gradient storage
        # (the backward of a split), which counted per parameter would count it again
        grads = list({id(p.grad.untyped_storage()): p.grad for p in params
                      if p.grad is not None}.values())
        grad_bytes = sum(g.untyped_storage().nbytes() for g in grads)
        grads_at_peak = sum(g.untyped_storage().nbytes() for g in grads
                            if (tracker.created_at(g) or 0) <= tracker.peak_op)
        by = tracker.peak_by_category
        held = tracker.live - tracker.by_category["params"] - grad_bytes
        return MicroBatchTrace(
            params=by.get("params", 0), grads=grad_bytes, peak=tracker.peak, peak_grads=grads_at_peak,
            peak_activations=by.get("activations", 0), peak_logits=by.get("logits", 0),
            peak_backward=by.get("backward", 0) - grads_at_peak, held_after=held, ops=tracker.ops)
