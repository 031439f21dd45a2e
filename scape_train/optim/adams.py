"""AdamS: Adam whose second moment is rebuilt each step from the previous momentum (spec §1).

One state tensor per parameter (``exp_avg``) plus a step counter, against AdamW's two:

    v   = β2·m_{t-1}² + (1-β2)·g²          (``official``: m_{t-1} divided by 1-β1^t first)
    m_t = β1·m_{t-1} + (1-β1)·g
    θ   = θ·(1 - lr·wd)
    θ   = θ - (lr / (1-β1^t)) · m_t / (sqrt(v)/sqrt(1-β2^t) + eps)     (``adam`` correction)

:func:`adams_update_` is the single implementation of that update; :class:`AdamS` applies it per
parameter and SCAPE applies it to its reconstructed gradient (with a mask that zeroes the momentum
off the communicated coordinates).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

BIAS_CORRECTIONS = ("adam", "official", "none")


def adams_update_(param: torch.Tensor, exp_avg: torch.Tensor, grad: torch.Tensor, *, step: int,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  bias_correction: str = "adam", mask: torch.Tensor | None = None) -> None:
    """One AdamS step on one tensor, in place on ``param`` and ``exp_avg`` (``step`` is 1-based).

    ``mask`` (bool, same shape), when given, zeroes the new momentum where it is False. There the
    gradient is zero too (SCAPE's off-mask coordinates), so the step is exactly 0 and the
    parameter receives the decoupled weight decay only.
    """
    if bias_correction not in BIAS_CORRECTIONS:
        raise ValueError(f"bias_correction must be one of {BIAS_CORRECTIONS}, "
                         f"got {bias_correction!r}")
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    # The denominator uses the *previous* momentum and the current gradient: build it first.
    prev = exp_avg / bc1 if bias_correction == "official" else exp_avg
    v = prev.square().mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    if mask is not None:
        exp_avg.masked_fill_(~mask, 0.0)
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    denom = v.sqrt_()
    if bias_correction == "adam":
        denom.div_(math.sqrt(bc2))
        step_size = lr / bc1
    elif bias_correction == "official":
        step_size = lr / bc1
    else:
        step_size = lr
    denom.add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamS(torch.optim.Optimizer):
    """Dense AdamS (spec §1). Param groups may set their own ``weight_decay`` (0 for 1-D)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1, bias_correction: str = "adam"):
        if lr < 0:
            raise ValueError(f"AdamS: lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"AdamS: betas must be two values in [0, 1), got {betas}")
        if eps < 0:
            raise ValueError(f"AdamS: eps must be >= 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"AdamS: weight_decay must be >= 0, got {weight_decay}")
        if bias_correction not in BIAS_CORRECTIONS:
            raise ValueError(f"AdamS: bias_correction must be one of {BIAS_CORRECTIONS}, "
                             f"got {bias_correction!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamS does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                adams_update_(p, state["exp_avg"], p.grad, step=state["step"], lr=group["lr"],
                              beta1=beta1, beta2=beta2, eps=group["eps"],
                              weight_decay=group["weight_decay"],
                              bias_correction=group["bias_correction"])
        return loss
