"""Weights & Biases, on rank 0 only. The run id is saved in the checkpoint and reused on resume,
so a resumed job continues the same W&B run."""

from __future__ import annotations

import logging
import secrets
import string
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def new_run_id() -> str:
    """An 8-character W&B-style id ([a-z0-9]), generated here: the helper's location in the
    wandb package has moved between releases."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def init_wandb(cfg_wandb, run_name: str, run_dir: Path, config: dict[str, Any],
               run_id: str | None):
    """(wandb run or None, run id). ``mode=disabled`` imports nothing and returns (None, run_id)."""
    if cfg_wandb.mode == "disabled":
        return None, run_id
    import wandb

    run_id = run_id or new_run_id()
    try:
        run = wandb.init(project=cfg_wandb.project, entity=cfg_wandb.entity,
                         name=cfg_wandb.name or run_name, group=cfg_wandb.group,
                         tags=list(cfg_wandb.tags), mode=cfg_wandb.mode, id=run_id,
                         resume="allow", dir=str(run_dir), config=config)
    except Exception as exc:  # noqa: BLE001 - wandb raises many kinds; all mean the same to a user
        raise RuntimeError(
            f"W&B could not start in mode {cfg_wandb.mode!r} ({exc}). Run `wandb login`, or use "
            "logging.wandb.mode=offline (sync later with `wandb sync`) or logging.wandb.mode=disabled."
        ) from exc
    return run, run_id
