"""Every cheap precondition of a run, checked together before any expensive work.

``check_preconditions(cfg, info)`` runs first in ``Trainer.__init__``, before the lm-eval task
index, the tokenizer, the model, the data and the run directory: one error lists every problem
found (exit status 1 from ``python -m scape_train``, no traceback), and nothing has been written.

    config      ``config.config_problems``: everything ``validate()`` checks, all at once
    hub         one short probe (``data/hub.py``), only when a hub dataset or a hub tokenizer that
                is not in the local cache is configured; HF_HUB_OFFLINE and friends are honoured
    W&B         online needs an API key (WANDB_API_KEY or ``wandb login``) and a reachable server
    paths       the run directory (or outputs/<run_name>) and the tokenizer cache can be created
    inputs      local data files, the resume target, eval.local_data files exist

Rank 0 checks (the probes run once per job, not once per rank) and broadcasts the verdict, so
every rank stops with the same message.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scape_train.config import Config, ConfigError, config_problems, format_problems


class PreconditionError(ConfigError):
    """One or more preconditions fail; ``problems`` lists them, the message says what to change."""

    def __init__(self, problems: list[str]):
        super().__init__(format_problems(problems))
        self.problems = list(problems)


def check_preconditions(cfg: Config, info=None) -> None:
    """Raise PreconditionError listing every problem (rank 0 decides; all ranks raise)."""
    problems = preconditions(cfg, info.world_size if info is not None else 1) \
        if info is None or info.is_main else None
    if info is not None and info.world_size > 1:
        from scape_train.distributed import broadcast_object

        problems = broadcast_object(problems, info)
    if problems:
        raise PreconditionError(problems)


def preconditions(cfg: Config, world_size: int = 1) -> list[str]:
    """Every problem found, config first; the network probes run concurrently, each bounded."""
    problems = config_problems(cfg, world_size)
    problems += input_problems(cfg)
    problems += path_problems(cfg)
    from scape_train.tracking import wandb_problem

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="preflight") as pool:
        hub = pool.submit(hub_problems, cfg)
        wandb = pool.submit(wandb_problem, cfg.logging.wandb)
        problems += hub.result()
        if wandb.result():
            problems.append(wandb.result())
    return problems


# -- the hub -----------------------------------------------------------------------------------

def hub_needs(cfg: Config) -> list[tuple[str, str]]:
    """(what needs the hub, the offline alternative) for this config; empty when nothing does."""
    from scape_train.data.sources import LOCAL_SOURCES, OFFLINE_HINT
    from scape_train.data.tokenizer import DEFAULT_HUB_IDS

    needs = []
    d, t = cfg.data, cfg.data.tokenizer
    if d.source not in LOCAL_SOURCES and d.path:
        needs.append((f"data.source={d.source} (hub dataset {d.path!r})", OFFLINE_HINT))
    if t.kind in ("gpt2", "sentencepiece", "hf"):
        path = t.path or DEFAULT_HUB_IDS.get(t.kind)
        if path and not Path(path).expanduser().exists() and not path.startswith((".", "/", "~")) \
                and not _tokenizer_cached(t.kind, path):
            needs.append((f"data.tokenizer.path={path!r} (kind={t.kind}, not in the local cache)",
                          f"data.tokenizer.path=<local dir with the tokenizer files>"))
    return needs


_TOKENIZER_FILES = {"sentencepiece": ("tokenizer.model",), "gpt2": ("vocab.json",),
                    "hf": ("tokenizer.json", "tokenizer_config.json")}


def _tokenizer_cached(kind: str, repo_id: str) -> bool:
    """Is the hub tokenizer in the local Hugging Face cache (loadable offline)?"""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for name in _TOKENIZER_FILES.get(kind, ()):
        try:
            if isinstance(try_to_load_from_cache(repo_id, name), str):
                return True
        except Exception:  # noqa: BLE001 - an id the cache cannot parse is not cached
            return False
    return False


def hub_problems(cfg: Config) -> list[str]:
    needs = hub_needs(cfg)
    if not needs:
        return []
    from scape_train.data.hub import hub_problem

    problem = hub_problem()          # probed once, with a short timeout
    if problem is None:
        return []
    return [f"{what} needs the Hugging Face Hub, but {problem}. Offline, use {alternative}"
            for what, alternative in needs]


# -- paths and inputs --------------------------------------------------------------------------

def _creatable(path: Path) -> str | None:
    """None if ``path`` is a writable directory or could be created as one, else why not."""
    path = Path(path).expanduser().absolute()
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def path_problems(cfg: Config) -> list[str]:
    problems = []
    run_dir = Path(cfg.run_dir) if cfg.run_dir else Path("outputs") / cfg.run_name
    why = _creatable(run_dir)
    if why:
        key = "run_dir" if cfg.run_dir else f"outputs/{cfg.run_name} (run_dir=null)"
        problems.append(f"the run directory cannot be written: {key}: {why}; choose another "
                        "run_dir=... (or launch from a writable directory)")
    t = cfg.data.tokenizer
    if t.kind == "trained_bpe":
        cache = Path(t.cache_dir or "~/.cache/scape_train/tokenizers")
        why = _creatable(cache)
        if why:
            problems.append(f"the tokenizer cache cannot be written: data.tokenizer.cache_dir="
                            f"{cache}: {why}; set data.tokenizer.cache_dir=<writable dir>")
    return problems


def input_problems(cfg: Config) -> list[str]:
    from scape_train.checkpoint import MANIFEST, CheckpointManager
    from scape_train.data.sources import LOCAL_SOURCES, _split_files

    problems = []
    d = cfg.data
    if d.source in LOCAL_SOURCES:
        splits = [d.train_split] + ([d.val_split] if d.val_split else [])
        for split in splits:
            try:
                _split_files(d, split)
            except (FileNotFoundError, ValueError) as exc:
                problems.append(str(exc))
                break            # the same path fails for every split: once is enough
    elif not d.path:
        problems.append(f"data.source={d.source!r} reads the hub and needs data.path=<hub dataset id>")
    t = d.tokenizer
    if t.kind != "trained_bpe" and t.path and t.path.startswith((".", "/", "~")) \
            and not Path(t.path).expanduser().exists():
        problems.append(f"data.tokenizer.path={t.path!r} does not exist")
    if cfg.resume not in ("none", "auto", ""):
        target = Path(cfg.resume).expanduser()
        root = target / "checkpoints" if (target / "checkpoints").is_dir() else target
        if not target.exists():
            problems.append(f"resume={cfg.resume}: no such directory (give a checkpoint directory, "
                            "a run directory, or resume=auto)")
        elif not (target / MANIFEST).is_file() and not CheckpointManager(root, None).list():
            problems.append(f"resume={cfg.resume}: no checkpoint there (expected a checkpoint "
                            "directory with manifest.json, or a run directory with checkpoints/)")
    if cfg.eval.enabled:
        for task, raw in dict(cfg.eval.local_data or {}).items():
            path = Path(str(raw)).expanduser()
            if not path.is_file():
                problems.append(f"eval.local_data.{task}={raw} is not a file (relative paths "
                                "resolve against the launch directory)")
    return problems
