"""The smallest config change that makes a plan fit, tried in a fixed order and re-planned each.

Order (cheapest in step time first, the global batch always kept):
    1. trainer.activation_checkpointing=selective, full_every_4, full_every_2, then full
       (selective recomputes each block's elementwise ops; full its whole forward: ~+30% FLOPs;
       full_every_N a block in N in full, the others selective)
    2. + halving trainer.micro_batch_size, with gradient accumulation keeping global_batch_size
    3. SCAPE: + optimizer.offload_residuals=true, + optimizer.sharded=true, both; then with halving
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterator

from scape_train.config import Config
from scape_train.plan.devices import DeviceSpec
from scape_train.plan.estimate import MemoryPlan, checkpointing_of, plan_memory

Change = list[tuple[str, Any]]


@dataclass
class Fix:
    changes: Change
    plan: MemoryPlan

    @property
    def overrides(self) -> str:
        return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.changes)


def _with(cfg: Config, changes: Change) -> Config:
    out = copy.deepcopy(cfg)
    for dotted, value in changes:
        node = out
        *path, leaf = dotted.split(".")
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return out


def _halvings(cfg: Config, world: int) -> Iterator[Change]:
    t = cfg.trainer
    keep = t.global_batch_size or t.micro_batch_size * world
    global_change = [] if t.global_batch_size else [("trainer.global_batch_size", keep)]
    micro = t.micro_batch_size
    while micro % 2 == 0:
        micro //= 2
        yield [("trainer.micro_batch_size", micro)] + global_change


def candidates(cfg: Config, world: int) -> Iterator[Change]:
    """Every change to try, smallest first."""
    from scape_train.models.checkpointing import stronger_than

    current = checkpointing_of(cfg)
    stronger = stronger_than(current)
    for policy in stronger[:-1]:
        yield [("trainer.activation_checkpointing", policy)]
    # the rest with the most saving policy (auto: already tried at start-up)
    ac: Change = [("trainer.activation_checkpointing", "full")] if current != "full" else []
    if ac:
        yield ac
    for halve in _halvings(cfg, world):
        yield ac + halve
    o = cfg.optimizer
    if cfg.strategy.name == "data_parallel" and o.name == "scape":
        extras: list[Change] = []
        if not o.offload_residuals:
            extras.append([("optimizer.offload_residuals", True)])
        if not o.sharded:
            extras.append([("optimizer.sharded", True)])
        if not o.offload_residuals and not o.sharded:
            extras.append([("optimizer.sharded", True), ("optimizer.offload_residuals", True)])
        for extra in extras:
            yield ac + extra
        for extra in extras:
            for halve in _halvings(cfg, world):
                yield ac + extra + halve


def smallest_fix(cfg: Config, world: int, device: DeviceSpec) -> Fix | None:
    """The first candidate whose plan fits, or None when none does. A candidate whose closed-form
    bound fits fits (the bound is above the trace); only the others are traced, so the answer is
    the same as tracing every one, sooner."""
    for change in candidates(cfg, world):
        plan = plan_memory(_with(cfg, change), world, device, trace="auto", label=cfg.run_name)
        if plan.fits:
            return Fix(change, plan)
    return None
