"""Small shared helpers for tests: composing the real Hydra config."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from scape_train.config import Config, register_configs, to_object

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def compose_config(overrides: list[str] | None = None) -> Config:
    """The typed config exactly as ``python -m scape_train <overrides>`` would build it."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        node = compose(config_name="config", overrides=list(overrides or []))
    return to_object(node)
