"""What SCAPE carries from one step to the next: the one object the reference engines
(:mod:`.replicated`, :mod:`.sharded`) and the fused engines (:mod:`.fused`) both work on, so
that the strategy can run either engine on any step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .residual import ResidualStore


@dataclass
class ScapeState:
    m: torch.Tensor                 # the momentum: all of it (§2) or the owner's range (§3)
    residual: ResidualStore         # this rank's full-size residual: e (§2) or ε (§3)
    rho: torch.Tensor | None = None             # §3: the owner's shared residual ρ
    update_residual: torch.Tensor | None = None  # §3, low-precision payload: see ShardedScape
