"""Local-step strategies' typed config (Hydra group ``strategy``); see docs/gasloc.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class StrategyConfig:
    # data_parallel: the optimizer group's own communication every step (DDP, SCAPE, ...)
    # diloco | gasloc: local inner steps with the optimizer group's optimizer, then an exchange
    name: str = "data_parallel"
    topology: str = "complete"        # gasloc: complete | 1peer | 2peer
    inner_steps: int = 30             # H; a round counts as H steps for the trainer (progress)
    inner_steps_per_worker: List[int] = field(default_factory=list)  # per-rank H_i (overrides H)
    round_budget_s: float = 0.0       # > 0: rounds bounded by wall-clock; slow workers take fewer steps
    outer_lr: float = 0.7             # eta
    outer_momentum: float = 0.9       # mu (DiLoCo) / gamma (GASLoC)
    outer_state_on_cpu: bool = False  # keep the outer optimizer's state in host memory
    mix_momentum: bool = True         # ablation: False mixes y and adds the momentum term after
    seed: int = 0                     # the mixing graph's RNG seed (with the round number)
    max_rounds: Optional[int] = None  # informational: the run ends at trainer.max_steps, i.e.
                                      # after max_steps // inner_steps rounds; validated >= 1
