"""One AdamS step's constants, and the signature every implementation of dense AdamS shares
(:mod:`.adams` chooses one: the reference, :mod:`.adams_foreach` or :mod:`.adams_triton`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class AdamSConstants:
    """One bucket's AdamS constants at one step, as :func:`adams_update_` computes them."""
    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: str = "adam"

    @property
    def bc1(self) -> float:
        return 1.0 - self.beta1 ** self.step

    @property
    def sqrt_bc2(self) -> float:
        return math.sqrt(1.0 - self.beta2 ** self.step)

    @property
    def step_size(self) -> float:
        return self.lr if self.bias_correction == "none" else self.lr / self.bc1

    @property
    def decay(self) -> float:
        """θ's decoupled weight-decay factor."""
        return 1.0 - self.lr * self.weight_decay


# params, grads, exp_avgs of one bucket, its constants, the clipping coefficient (0-d, or None)
AdamSUpdate = Callable[[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                        AdamSConstants, "torch.Tensor | None"], None]
