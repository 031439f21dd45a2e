"""``python -m scape_train.plan +experiment=NAME [plan.device=h100-80gb] [plan.world_size=8] [key=value ...]``

Composes the trainer's own config (configs/config.yaml, any override), prints the per-rank memory
plan -- every component in GiB per phase, the total, the device's capacity and the verdict -- and,
when it does not fit, the smallest change that does, as overrides to paste. Nothing is built but
fake tensors; no data is read. Exit status: 0 fits, 1 does not fit, 2 the config itself is invalid.

Examples:
    python -m scape_train.plan +experiment=llama500m_s99 plan.device=h100-80gb plan.world_size=8
    python -m scape_train.plan +experiment=tiny_s99 plan.device=cpu
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from scape_train.config import ConfigError, register_configs, to_object, validate

register_configs()


def main_with(cfg) -> int:
    from scape_train.plan.check import device_for, validate_plan_config
    from scape_train.plan.estimate import plan_memory
    from scape_train.plan.fixes import smallest_fix
    from scape_train.plan.report import format_fix, format_plan

    validate_plan_config(cfg.plan)
    world = cfg.plan.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world)
    device = device_for(cfg.plan, world)
    plan = plan_memory(cfg, world, device, trace=True)
    print(format_plan(plan))
    if plan.fits:
        return 0
    print(format_fix(plan, smallest_fix(cfg, world, device)))
    return 1


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def _hydra_main(node: DictConfig) -> None:
    try:
        code = main_with(to_object(node))
    except (ConfigError, ValueError) as exc:
        if os.environ.get("SCAPE_TRACEBACK") == "1":
            raise
        print(f"\nscape_train.plan: error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
