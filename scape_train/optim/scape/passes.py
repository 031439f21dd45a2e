"""What the fused step's passes take besides tensors: the parameters' segments of the mask (and
one AdamS step's constants, dense AdamS's :class:`..adams_constants.AdamSConstants`); shared by
the two implementations (:mod:`.torch_passes`, :mod:`.triton_passes`), one of which
:func:`.strategy.select_passes` picks once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ParamSegment(NamedTuple):
    """One owner segment of the mask's sorted flat index list: θ's flat view, the tensor's flat
    offset, the index-list slice ``[a, b)`` of its ones, its elements ``[s0, s1)`` in the tensor,
    the tensor's weight-decay coefficient ``wd`` (θ's factor ``1 - lr·wd``, :meth:`decay`, is
    applied off the mask as the passes walk θ), and where ``[a, b)``'s values start in a gathered
    buffer (the sharded parameter all-gather). Nothing in it depends on the step: the engines
    build a mask plan's segments once."""
    param: torch.Tensor
    offset: int
    a: int
    b: int
    s0: int
    s1: int
    wd: float
    src: int = 0

    def decay(self, lr: float) -> float:
        """θ's weight-decay factor at learning rate ``lr``."""
        return 1.0 - lr * self.wd


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, C / (‖ĝ‖ + 1e-6))`` as a tensor, like ``clip_grad_norm_``."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


class Clip(NamedTuple):
    """Clipping by the global norm, as the AdamS pass takes it: ĝ·min(1, C / (‖ĝ‖ + 1e-6))
    (:func:`clip_coef`), with ‖ĝ‖ a float32 0-d tensor on the device."""
    norm: torch.Tensor
    max_norm: float


def flat_buffer(grads: list[torch.Tensor], offsets: list[int]) -> torch.Tensor | None:
    """The one flat buffer the per-tensor gradients are views of, each at its flat offset
    (``optimizer.flat_grads``), or ``None``."""
    g0 = grads[0]
    base, size = g0.data_ptr(), g0.element_size()
    if any(g.data_ptr() != base + size * offsets[i] for i, g in enumerate(grads)):
        return None
    return g0.as_strided((offsets[-1],), (1,), g0.storage_offset())
