"""One flat buffer for every parameter's gradient: ``p.grad`` are views into it.

Autograd accumulates into a ``.grad`` that already exists in place (``grad += new``, with grad
mode off, i.e. any backward without ``create_graph``), so once the views are attached every
backward writes straight into the buffer, micro-batch after micro-batch, and a strategy reads the
whole gradient as one contiguous tensor -- no ``torch.cat``, no per-step allocation, a size the
memory plan knows before the first step. What it costs: the gradients are held through the
forward too (4 bytes per parameter), and the first micro-batch's gradients are added to a zeroed
buffer instead of being stolen by ``.grad`` (a read and a write per element more).

Two things can detach a view, and both are handled rather than trusted:
  - code that sets ``p.grad`` itself (a test, ``model.zero_grad()`` which sets ``None``, a
    ``create_graph=True`` backward, which replaces ``.grad`` out of place): :meth:`flat` copies
    such a gradient into its slot and re-attaches the view, with a one-time warning;
  - a parameter that took no part in the loss: its slot stays zero, which no buffer can tell from
    a zero gradient, so each parameter's post-accumulate hook marks it, and :meth:`flat` names a
    parameter that was never marked (SCAPE's contract: every trainable parameter takes part).
"""

from __future__ import annotations

import warnings

import torch


class FlatGradBuffer:
    def __init__(self, names: list[str], params: list[torch.nn.Parameter], what: str):
        self.names, self.params, self.what = names, params, what
        total = sum(p.numel() for p in params)
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise TypeError(f"{what}: one flat gradient buffer needs one parameter dtype, got "
                            f"{sorted(map(str, dtypes))}")
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self._flat_views = [v.view(-1) for v in self.views]
        self.touched = [False] * len(params)
        self._warned = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._marker(i))
                       for i, p in enumerate(params)]
        self.attach()

    def _marker(self, i: int):
        def mark(_param) -> None:
            self.touched[i] = True
        return mark

    def attach(self) -> None:
        """Point every ``p.grad`` at its slot (the buffer's current contents)."""
        for p, v in zip(self.params, self.views):
            p.grad = v

    def zero_(self) -> None:
        """Before the next backward: the buffer zeroed, the views attached (one fill)."""
        self.buffer.zero_()
        self.attach()
        self.touched = [False] * len(self.params)

    def mark_written(self) -> None:
        """The caller wrote every gradient into its view in place, not through a backward (e.g.
        gradients computed with ``torch.func`` and copied in): nothing is checked for them."""
        self.touched = [True] * len(self.params)

    def _is_view(self, i: int) -> bool:
        return self.params[i].grad is self.views[i]   # autograd adds in place: the same tensor

    def flat(self) -> torch.Tensor:
        """The whole gradient, flat (the buffer itself: a step may consume it in place).
        Gradients that were set by hand land in their slots first; a parameter without any
        gradient is an error that names it."""
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            if self._is_view(i):
                if not self.touched[i] and self._hooks:
                    self._untouched(i)
                continue
            if p.grad is None:
                raise RuntimeError(f"{self.what}: parameter {name!r} has no gradient. Every "
                                   "trainable parameter must take part in the loss (or set "
                                   "requires_grad=False before building the optimizer)")
            if not self._warned:
                warnings.warn(f"{self.what}: parameter {name!r}'s .grad is not its view of the "
                              "flat gradient buffer (set by hand, model.zero_grad(), or a "
                              "create_graph backward); copying it in. Zero gradients through "
                              "the strategy's zero_grad() to keep them in place", stacklevel=3)
                self._warned = True
            self.views[i].copy_(p.grad)
            p.grad = self.views[i]
        self.touched = [True] * len(self.params)
        return self.buffer

    def _untouched(self, i: int) -> None:
        """A view no backward accumulated into since the last :meth:`zero_`: its gradient was
        written by hand in place (fine), or the parameter took no part in the loss (an error).
        Told apart by the slot's contents: a hand-written gradient is not all zeros."""
        if not bool(self.views[i].any()):   # a host read, on this rare path only
            raise RuntimeError(f"{self.what}: parameter {self.names[i]!r} has no gradient "
                               "(no backward reached it since zero_grad). Every trainable "
                               "parameter must take part in the loss (or set "
                               "requires_grad=False before building the optimizer)")

    def per_tensor(self) -> list[torch.Tensor]:
        """:meth:`flat`'s gradient as flat per-parameter views (for per-tensor passes)."""
        self.flat()
        return self._flat_views

    def close(self) -> None:
        """Remove the hooks (the views stay; a missing gradient is no longer detected)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def write_grads(params, grads, buffer: FlatGradBuffer | None = None) -> None:
    """Gradients computed elsewhere (benchmarks, tests), set where a backward would leave them:
    copied into ``buffer``'s views (attached first: several strategies may share a model), or,
    without a buffer, as the parameters' ``.grad``."""
    if buffer is None:
        for p, g in zip(params, grads):
            p.grad = g
        return
    buffer.attach()
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    buffer.mark_written()
