"""The memory plan's typed config (``plan.*`` under the root config, for both entry points)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlanConfig:
    device: str = "auto"     # h100-80gb | h200-141gb | a100-80gb | a100-40gb | cpu | auto (this machine)
    world_size: int = 0      # ranks the plan is for; 0 = the launch's world size (1 without torchrun)
    check: str = "auto"      # auto: the trainer refuses to start when the plan does not fit | off
