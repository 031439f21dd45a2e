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
    from scape_train.tracking import WandbError
    from scape_train.train import NonFiniteLossError

    return (ConfigError, CheckpointError, NonFiniteLossError, ValueError, FileNotFoundError,
            ConnectionError, WandbError)


# What gloo / NCCL / the rendezvous store say when another rank died or stopped answering.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "timeout", "timed out")


def peer_lost_message(exc: BaseException) -> str | None:
    """A one-paragraph message when a collective failed because another rank died or hung."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    text = str(exc).strip()
    if world <= 1 or not isinstance(exc, RuntimeError) or not (
            isinstance(exc, dist.DistError) or any(s in text.lower() for s in _PEER_LOST)):
        return None
    first = text.splitlines()[0] if text else type(exc).__name__
    return (f"rank {os.environ.get('RANK', '?')} of {world} lost contact with the other ranks "
            f"({first}). Another rank most likely crashed, was killed, or did not answer within "
            "trainer.dist_timeout_s; its own log says why. Nothing was saved after the last "
            "checkpoint: restart the whole job with resume=auto to continue from it.")


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
    except RuntimeError as exc:
        message = peer_lost_message(exc)
        if message is None or os.environ.get("SCAPE_TRACEBACK") == "1":
            raise
        print(f"\nscape_train: error: {message}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    from scape_train.config import override_key_problems

    # Hydra reports a typo'd key without the closest valid one, and lets +new.key=... through to
    # --cfg/--help unchecked: both are refused here first, naming the key and the closest one.
    problems = override_key_problems(sys.argv[1:])
    if problems:
        print("scape_train: error: " + "\n".join(problems), file=sys.stderr)
        sys.exit(1)
    _hydra_main()


if __name__ == "__main__":
    main()
