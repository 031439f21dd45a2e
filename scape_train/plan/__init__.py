"""The memory plan: per-device peak memory of a composed config, before any data or model work.

    python -m scape_train.plan +experiment=NAME [plan.device=h100-80gb] [plan.world_size=8]

``estimate.plan_memory`` builds the plan (the model's forward/backward traced on fake tensors, the
optimizer's state and step replayed from its code), ``fixes.smallest_fix`` finds the smallest config
change that fits, ``check.check_memory`` is the trainer's start-up gate. See docs/memory_plan.md.
"""

from scape_train.plan.config import PlanConfig

__all__ = ["PlanConfig"]
