"""Weights & Biases, on rank 0 only. The run id is saved in the checkpoint and reused on resume,
so a resumed job continues the same W&B run.

Offline, W&B cannot resume a run (wandb 0.31: every ``wandb.init`` writes a new
``offline-run-<time>-<id>`` directory, and ``wandb sync`` of two directories with one id keeps
one of them). So a resumed offline run starts a new directory, replays into it the history up to
its checkpoint from ``metrics.jsonl`` (the run's own record, see ``metrics.continued_rows``),
and removes the earlier directories of that id: ``<run_dir>/wandb`` always holds one directory
per run, with one row per step, and ``wandb sync`` uploads the whole run. Online, W&B's own
resume (``resume="allow"`` with the saved id) continues the server's run.
"""

from __future__ import annotations

import logging
import netrc
import os
import secrets
import shutil
import string
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

FIX = ("run `wandb login` (or set WANDB_API_KEY), or use logging.wandb.mode=offline (written to "
       "<run_dir>/wandb; `wandb sync` uploads it later) or logging.wandb.mode=disabled")


class WandbError(RuntimeError):
    """W&B could not start; the message says how to fix it."""


def new_run_id() -> str:
    """An 8-character W&B-style id ([a-z0-9]), generated here: the helper's location in the
    wandb package has moved between releases."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def base_url() -> str:
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").rstrip("/")


def has_credentials() -> bool:
    """Does W&B have an API key here without asking? WANDB_API_KEY, an identity token file, or
    the netrc entry ``wandb login`` writes (``$NETRC``, else ``~/.netrc``)."""
    if os.environ.get("WANDB_API_KEY", "").strip() or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    if not path.is_file():
        return False
    try:
        entry = netrc.netrc(str(path)).authenticators(urlparse(base_url()).netloc)
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(entry and entry[2])


def wandb_problem(cfg_wandb, probe: bool = True) -> str | None:
    """Why ``logging.wandb`` cannot start here (online without a key, or without the server), or
    None. Cheap: environment and netrc, then one short TCP probe."""
    if cfg_wandb.mode != "online":
        return None
    if not has_credentials():
        host = urlparse(base_url()).netloc
        return (f"logging.wandb.mode=online, but W&B has no API key here (WANDB_API_KEY is unset "
                f"and no {host} entry is in ~/.netrc): {FIX}")
    if probe:
        from scape_train.data.hub import probe_target, tcp_problem

        problem = tcp_problem(*probe_target(base_url()))
        if problem is not None:
            return (f"logging.wandb.mode=online, but the W&B server {problem}: use "
                    "logging.wandb.mode=offline (`wandb sync` uploads it later) or "
                    "logging.wandb.mode=disabled")
    return None


def offline_run_dirs(run_dir: Path, run_id: str) -> list[Path]:
    """This run's offline W&B directories (``offline-run-<time>-<id>[-<n>]``), oldest first."""
    found = []
    for root in (Path(run_dir) / "wandb", Path(run_dir) / ".wandb"):
        if root.is_dir():
            found += [p for p in root.glob("offline-run-*") if p.is_dir() and not p.is_symlink()
                      and (p.name.endswith(f"-{run_id}") or f"-{run_id}-" in p.name)]
    return sorted(found)


def init_wandb(cfg_wandb, run_name: str, run_dir: Path, config: dict[str, Any],
               run_id: str | None, step: int = 0):
    """(wandb run or None, run id). ``mode=disabled`` imports nothing and returns (None, run_id).

    ``step`` is the step the run resumes from (0 for a new run): offline, the history up to it
    is replayed from ``<run_dir>/metrics.jsonl`` and the earlier offline directories of this run
    are removed, so the run stays one directory."""
    if cfg_wandb.mode == "disabled":
        return None, run_id
    import wandb

    run_id = run_id or new_run_id()
    offline = cfg_wandb.mode == "offline"
    earlier = offline_run_dirs(run_dir, run_id) if offline else []
    try:
        run = wandb.init(project=cfg_wandb.project, entity=cfg_wandb.entity,
                         name=cfg_wandb.name or run_name, group=cfg_wandb.group,
                         tags=list(cfg_wandb.tags), mode=cfg_wandb.mode, id=run_id,
                         resume="allow", dir=str(run_dir), config=config)
    except Exception as exc:  # noqa: BLE001 - wandb raises many kinds; all mean the same to a user
        raise WandbError(f"W&B could not start in mode {cfg_wandb.mode!r} ({exc}): {FIX}.") from exc
    if offline and step > 0:
        replay_history(run, Path(run_dir) / "metrics.jsonl", step)
    current = Path(run.settings.sync_dir).resolve() if offline else None
    for old in earlier:
        if old.resolve() != current:
            shutil.rmtree(old, ignore_errors=True)
    if earlier:
        log.info("W&B offline run %s: %d earlier director%s replaced by %s", run_id, len(earlier),
                 "y" if len(earlier) == 1 else "ies", current)
    return run, run_id


def replay_history(run, metrics_path: Path, step: int) -> int:
    """Log the rows of ``metrics_path`` up to ``step`` into ``run`` (a resumed offline run)."""
    from scape_train.metrics import continued_rows

    start = time.perf_counter()
    rows = continued_rows(metrics_path, step)
    for row in rows:
        run.log({k: v for k, v in row.items() if k != "time"}, step=int(row["step"]))
    if rows:
        log.info("W&B offline: replayed %d rows up to step %d in %.1fs", len(rows), step,
                 time.perf_counter() - start)
    return len(rows)
