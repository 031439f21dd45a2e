"""Autoregressive generation for the in-tree models: greedy or sampled, with a KV cache.

    new_ids = generate(model, [prompt_ids, ...], max_new_tokens=100, temperature=0.8, top_k=50)

``temperature=0`` is greedy (argmax, ties to the lowest id, as Hugging Face's ``generate``).
Otherwise logits are divided by the temperature, cut to the ``top_k`` largest and to the smallest
set of probability ``top_p``, and sampled with ``generator`` (so a seed reproduces a sample and
the global RNG is left alone). Several prompts run as one left-padded batch (``models/cache.py``);
a row stops at ``eos_id``. ``use_cache=False`` recomputes the whole sequence each step (the
reference the cache is tested against).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from scape_train.models.cache import new_cache

log = logging.getLogger(__name__)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` [B, vocab] -> [B] (int64)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = (cum - sorted_logits.softmax(dim=-1)) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    pad_id: int = 0,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    autocast: Callable | None = None,
    on_tokens: Callable[[torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (without the prompt; a row ends at and excludes ``eos_id``).

    ``on_tokens(next_ids[B])`` is called after every step (streaming). ``max_new_tokens`` is cut
    so that prompt + new tokens fit ``model.cfg.max_seq_len`` (a warning says so). The model is
    put in eval mode and left there.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. the EOS or BOS id)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    limit = model.cfg.max_seq_len
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise ValueError(f"a prompt of {longest} tokens leaves no room within model.max_seq_len="
                         f"{limit}; shorten it")
    if longest + max_new_tokens > limit:
        log.warning("max_new_tokens=%d cut to %d: the model's context is %d tokens and the longest "
                    "prompt has %d", max_new_tokens, limit - longest, limit, longest)
        max_new_tokens = limit - longest
    device = next(model.parameters()).device
    autocast = autocast or _no_autocast
    model.eval()
    b = len(prompts)
    ids = torch.full((b, longest), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
    pad = torch.tensor([longest - len(p) for p in prompts], dtype=torch.long, device=device)
    padded = bool((pad > 0).any())
    out = torch.empty((b, 0), dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    cache = new_cache(model, longest + max_new_tokens, pad) if use_cache else None
    step_input = ids
    for _ in range(max_new_tokens):
        with autocast():
            if cache is not None:
                logits = model(step_input, cache=cache)[:, -1]
            elif padded:  # the whole sequence again, with the padding mask of a fresh cache
                seq = torch.cat([ids, out], dim=1)
                logits = model(seq, cache=new_cache(model, seq.shape[1], pad))[:, -1]
            else:         # the training forward on the whole sequence
                logits = model(torch.cat([ids, out], dim=1))[:, -1]
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
        out = torch.cat([out, nxt[:, None]], dim=1)
        if on_tokens is not None:
            on_tokens(nxt)
        if eos_id is not None:
            done |= nxt == eos_id
            if bool(done.all()):
                break
        step_input = nxt[:, None]
    rows = out.tolist()
    if eos_id is not None:
        rows = [r[:r.index(eos_id)] if eos_id in r else r for r in rows]
    return rows


def _no_autocast():
    import contextlib

    return contextlib.nullcontext()
