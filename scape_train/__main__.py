"""``python -m scape_train [+experiment=NAME] [key=value ...]``: compose the config, then train.

Expected failures (bad config, unusable checkpoint, non-finite loss, unreachable data) end with a
one-paragraph message and exit status 1, not a traceback; set SCAPE_TRACEBACK=1 to see one.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from scape_train.config import register_configs, to_object

register_configs()


def user_errors() -> tuple[type[BaseException], ...]:
    from scape_train.checkpoint import CheckpointError
    from scape_train.config import ConfigError
    from scape_train.train import NonFiniteLossError

    return (ConfigError, CheckpointError, NonFiniteLossError, ValueError, FileNotFoundError,
            ConnectionError)


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from scape_train.train import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(to_object(cfg))
    except user_errors() as exc:
        if os.environ.get("SCAPE_TRACEBACK") == "1":
            raise
        print(f"\nscape_train: error: {exc}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
