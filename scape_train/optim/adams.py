"""AdamS: Adam whose second moment is rebuilt each step from the previous momentum (spec §1).

One state tensor per parameter (``exp_avg``) plus a step counter, against AdamW's two:

    v   = β2·m_{t-1}² + (1-β2)·g²          (``official``: m_{t-1} divided by 1-β1^t first)
    m_t = β1·m_{t-1} + (1-β1)·g
    θ   = θ·(1 - lr·wd)
    θ   = θ - (lr / (1-β1^t)) · m_t / (sqrt(v)/sqrt(1-β2^t) + eps)     (``adam`` correction)

:func:`adams_update_` is the readable reference of that update, the one SCAPE applies to its
reconstructed gradient (with a mask that zeroes the momentum off the communicated coordinates).
:class:`AdamS` applies the same arithmetic to all its parameters at once, through one of three
implementations of :data:`AdamSUpdate`, chosen once by device (:func:`select_update`):

- ``reference``: :func:`adams_update_` per tensor (about ten torch ops, so launches, per tensor);
- ``foreach``: torch's multi-tensor ``_foreach_*`` ops, the same ops over every tensor in a
  bucket at once (:mod:`.adams_foreach`); on the CPU (its default there) over cache-sized slices
  of the bucket, which is faster than the reference;
- ``triton``: one kernel per bucket that reads θ, g and m once and writes θ and m once
  (:mod:`.adams_triton`; CUDA's default).

A bucket is a parameter group's tensors with the same step count and dtype (normally one per
group). Each path applies an optional clipping coefficient to g as it reads it, so that the
clipping's scaling pass over the gradients folds into the update.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Iterable

import torch

from .adams_constants import AdamSConstants, AdamSUpdate

BIAS_CORRECTIONS = ("adam", "official", "none")
IMPLS = ("auto", "reference", "foreach", "triton")


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


def reference_update(params: list[torch.Tensor], grads: list[torch.Tensor],
                     exp_avgs: list[torch.Tensor], c: AdamSConstants,
                     coef: torch.Tensor | None) -> None:
    """:data:`AdamSUpdate` by :func:`adams_update_`, one tensor at a time."""
    for p, g, m in zip(params, grads, exp_avgs):
        adams_update_(p, m, g if coef is None else g * coef, step=c.step, lr=c.lr, beta1=c.beta1,
                      beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay,
                      bias_correction=c.bias_correction)


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernel can run on ``device``'s tensors: CUDA with triton importable,
    or any device under ``TRITON_INTERPRET=1`` (set before triton is first imported)."""
    from .scape.kernels import triton_available

    interpreted = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")
    return triton_available() and (device.type == "cuda" or interpreted)


def select_update(impl: str, device: torch.device) -> AdamSUpdate:
    """The :data:`AdamSUpdate` for tensors on ``device``: ``auto`` is ``triton`` on CUDA where
    triton imports, else ``foreach``."""
    device = torch.device(device)
    if impl not in IMPLS:
        raise ValueError(f"AdamS: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "triton" if device.type == "cuda" and triton_usable(device) else "foreach"
    if impl == "reference":
        return reference_update
    if impl == "foreach":
        from .adams_foreach import chunked_update, foreach_update

        return chunked_update if device.type == "cpu" else foreach_update
    if not triton_usable(device):
        raise RuntimeError(f"AdamS: the triton implementation cannot run on {device}: it needs "
                           "triton and a CUDA device (or TRITON_INTERPRET=1 set before triton is "
                           "first imported); choose impl foreach (optimizer.use_triton=off)")
    from .adams_triton import TritonAdamS   # imports triton: only when chosen

    return TritonAdamS(device)


class AdamS(torch.optim.Optimizer):
    """Dense AdamS (spec §1). Param groups may set their own ``weight_decay`` (0 for 1-D).

    ``impl`` (see the module docstring) is resolved once, by the first parameter's device.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1, bias_correction: str = "adam",
                 impl: str = "auto"):
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
        first = next((p for g in self.param_groups for p in g["params"]), None)
        self.update = select_update(impl, first.device if first is not None else "cpu")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *,
             grad_coef: torch.Tensor | None = None):
        """One step. ``grad_coef`` (a 0-d tensor on the parameters' device, e.g. a clipping
        coefficient) scales every gradient as it is read; ``p.grad`` is left as it is."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple, tuple[list, list, list]] = {}
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
                ps, gs, ms = buckets.setdefault((state["step"], p.dtype), ([], [], []))
                ps.append(p)
                gs.append(p.grad)
                ms.append(state["exp_avg"])
            for (step, _), (ps, gs, ms) in buckets.items():
                c = AdamSConstants(step, group["lr"], *group["betas"], group["eps"],
                                   group["weight_decay"], group["bias_correction"])
                self.update(ps, gs, ms, c, grad_coef)
        return loss
