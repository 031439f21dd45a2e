"""The trainer's start-up gate: refuse a config whose plan does not fit, before any work starts.

Called by ``Trainer.__init__`` right after ``validate``: nothing has been built or written yet, so
an oversized run fails in seconds with the change that fits, instead of being OOM-killed minutes
later. Rank 0 plans and broadcasts its decision, so all ranks stop together (host memory, read on
each rank, would differ slightly). Cheap for small jobs: the closed-form bound decides without a
trace when it fits (``estimate.plan_memory(trace="auto")``).
"""

from __future__ import annotations

import logging
import os

from scape_train import distributed as D
from scape_train.config import Config, ConfigError
from scape_train.plan.config import PlanConfig
from scape_train.plan.devices import DEVICE_NAMES, DeviceSpec, resolve_device
from scape_train.plan.estimate import (MemoryPlan, checkpointing_of, choose_checkpointing,
                                       plan_memory, with_checkpointing)

log = logging.getLogger("scape_train.plan")


def validate_plan_config(p: PlanConfig) -> None:
    if p.device not in DEVICE_NAMES:
        raise ConfigError(f"plan.device={p.device!r} is unknown; use one of {', '.join(DEVICE_NAMES)}")
    if p.world_size < 0:
        raise ConfigError(f"plan.world_size must be >= 0 (0 = the launch's world size), got {p.world_size}")
    if p.check not in ("auto", "off"):
        raise ConfigError(f"plan.check must be auto or off, got {p.check!r}")


def ranks_on_this_host(world: int) -> int:
    """Ranks sharing this host's memory: torchrun's LOCAL_WORLD_SIZE, else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def device_for(p: PlanConfig, world: int, device_type: str = "", cuda_index: int | None = None) -> DeviceSpec:
    """``plan.device``; ``auto`` follows the trainer's device (``device_type``) when given."""
    name = p.device
    if name == "auto" and device_type == "cpu":
        name = "cpu"
    return resolve_device(name, ranks_on_host=ranks_on_this_host(world), cuda_index=cuda_index)


def refusal(plan: MemoryPlan, cfg: Config) -> str:
    from scape_train.plan.fixes import smallest_fix
    from scape_train.plan.report import format_fix

    fix = smallest_fix(cfg, plan.world_size, plan.device)
    return (f"memory plan: {plan.verdict()}. {format_fix(plan, fix)}. Nothing was written. See the "
            "table with `python -m scape_train.plan <the same overrides>`; plan.check=off skips "
            "this check.")


def check_memory(cfg: Config, info: D.DistInfo) -> MemoryPlan | None:
    """Raise ConfigError (same message on every rank) when the plan does not fit."""
    p = cfg.plan
    validate_plan_config(p)
    if p.check == "off":
        return None
    world = p.world_size or info.world_size
    plan, message = None, None
    if info.is_main:
        device = device_for(p, world, info.device.type, info.device.index)
        plan = plan_memory(cfg, world, device, trace="auto")
        if plan.fits:
            log.info("%s", plan.verdict())
        else:
            message = refusal(plan, cfg)
    message = D.broadcast_object(message, info)
    if message is not None:
        raise ConfigError(message)
    return plan


def resolve_checkpointing(cfg: Config, info: D.DistInfo) -> Config:
    """``cfg`` with ``trainer.activation_checkpointing=auto`` replaced by the policy the memory plan
    picks for this device (``estimate.choose_checkpointing``; rank 0 plans, every rank gets its
    choice); any other value is returned as it is, spelled none|selective|full|full_every_N."""
    policy = checkpointing_of(cfg)
    if policy == "auto":
        choice = None
        if info.is_main:
            world = cfg.plan.world_size or info.world_size
            device = device_for(cfg.plan, world, info.device.type, info.device.index)
            choice = choose_checkpointing(cfg, world, device).activation_checkpointing
            log.info("activation checkpointing auto: %s (memory plan on %s)", choice, device.name)
        policy = D.broadcast_object(choice, info)
    return with_checkpointing(cfg, policy)
