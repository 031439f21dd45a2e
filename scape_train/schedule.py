"""Learning-rate schedules as pure functions of the step, so resuming needs no scheduler state."""

from __future__ import annotations

import math


def lr_at(step: int, *, kind: str, peak: float, min_lr: float, warmup: int, total: int,
          decay_steps: int = 0) -> float:
    """The lr of optimizer step ``step`` (1-based).

    cosine:   linear warmup to ``peak``, then cosine to ``min_lr`` at ``total``.
    wsd:      warmup, stable at ``peak``, then linear decay to ``min_lr`` over the last
              ``decay_steps`` (20% of ``total`` when 0).
    constant: warmup, then ``peak``.
    """
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    if kind == "constant":
        return peak
    if kind == "cosine":
        span = max(1, total - warmup)
        progress = min(1.0, (step - warmup) / span)
        return min_lr + 0.5 * (peak - min_lr) * (1.0 + math.cos(math.pi * progress))
    if kind == "wsd":
        decay = decay_steps or max(1, int(0.2 * total))
        start = total - decay
        if step <= start:
            return peak
        return peak + (min_lr - peak) * min(1.0, (step - start) / decay)
    raise ValueError(f"unknown lr schedule {kind!r}: use cosine, wsd or constant")
