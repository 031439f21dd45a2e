"""Which lm-eval tasks to run: presets, name validation, local data, loading with clear errors.

Presets (usable inside ``eval.tasks``, e.g. ``eval.tasks=[paper]``):

``paper`` — 16 tasks from the paper's evaluation families:
    lambada_openai, piqa, arc_easy, arc_challenge, mmlu, boolq, cb, copa, multirc, record,
    rte, wic, wsc, hellaswag, winogrande, openbookqa
(``mmlu`` is lm-eval's group of 57 subjects; ``rte`` is lm-eval's GLUE RTE, the same data as
SuperGLUE's; boolq/cb/copa/multirc/record/wic/wsc are lm-eval's SuperGLUE tasks.)

Task names are checked against lm-eval's index before any model is built. ``eval.local_data``
maps a task to a local file (jsonl/json/parquet/csv): a task YAML is generated in a temporary
include directory that ``include:``-s the built-in task's YAML by absolute path and only swaps
its dataset for that file, so prompts, targets, filters and metrics are those of a hub run and
the task keeps its name (``lambada_openai`` stays ``lambada_openai``).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from scape_train.eval.config import EvalConfig

log = logging.getLogger(__name__)

PRESETS: dict[str, list[str]] = {
    "paper": ["lambada_openai", "piqa", "arc_easy", "arc_challenge", "mmlu", "boolq", "cb", "copa",
              "multirc", "record", "rte", "wic", "wsc", "hellaswag", "winogrande", "openbookqa"],
}
# Where lm-eval 0.4.13 keeps these tasks (below lm_eval/tasks/): finding one this way avoids
# indexing ~14k built-in YAML files (~5 s) when every task runs from local data.
_KNOWN_YAML = {
    "lambada_openai": "lambada/lambada_openai.yaml",
    "lambada_standard": "lambada/lambada_standard.yaml",
    "piqa": "piqa/piqa.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "winogrande": "winogrande/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "sciq": "sciq/sciq.yaml",
}
_HOW_TO_LIST = ("list valid names with `lm_eval --tasks list` or, in Python, "
                "`lm_eval.tasks.TaskManager().all_tasks`; presets: " + ", ".join(PRESETS))
_BUILDERS = {".parquet": "parquet", ".csv": "csv"}     # anything else is read as json/jsonl


class TaskConfigError(ValueError):
    """A task name or eval.local_data entry that cannot work; raised before any model loads."""


class TaskDataUnavailableError(ConnectionError):
    """A task's dataset cannot be read (hub unreachable or offline, no local copy)."""


@dataclass
class TaskSetup:
    """The expanded task names and a TaskManager that knows them (local ones overridden)."""
    names: list[str]
    manager: Any                                   # lm_eval.tasks.TaskManager
    local: dict[str, Path] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory | None = None

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def expand_tasks(tasks: list[str]) -> list[str]:
    """Presets expanded in place, duplicates dropped, order kept."""
    out: list[str] = []
    for name in tasks:
        for t in PRESETS.get(str(name), [str(name)]):
            if t not in out:
                out.append(t)
    if not out:
        raise TaskConfigError(f"eval.tasks is empty; {_HOW_TO_LIST}")
    return out


def _builtin_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _builtin_index() -> dict[str, Any]:
    from lm_eval.tasks._index import TaskIndex

    return TaskIndex.build([_builtin_dir()])


def _unknown_error(unknown: list[str], known: list[str]) -> TaskConfigError:
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
        hints.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return TaskConfigError(f"unknown lm-eval task(s) in eval.tasks: {'; '.join(hints)}. {_HOW_TO_LIST}")


def _resolve_local(local_data: dict[str, str]) -> dict[str, Path]:
    out = {}
    for task, raw in local_data.items():
        path = Path(str(raw)).expanduser()
        if not path.is_absolute():
            # Hydra does not change the directory here, so this is the directory of the launch.
            path = Path.cwd() / path
        path = path.resolve()
        if not path.is_file():
            raise TaskConfigError(f"eval.local_data.{task}={raw} is not a file (resolved to {path}; "
                                  "relative paths resolve against the current directory)")
        out[str(task)] = path
    return out


def _local_yaml(task: str, builtin_yaml: Path, data_file: Path) -> dict[str, Any]:
    """A task config that includes the built-in one and reads its evaluation split from a file."""
    from lm_eval.tasks._yaml_loader import load_yaml

    base = load_yaml(builtin_yaml, resolve_func=False, recursive=True)
    if "class" in base:
        raise TaskConfigError(f"eval.local_data.{task}: {task} is a Python-class task; only YAML "
                              "tasks can be pointed at a local file")
    split = base.get("test_split") or base.get("validation_split")
    if not split:
        raise TaskConfigError(f"eval.local_data.{task}: the built-in task has no test or validation "
                              "split to replace")
    cfg: dict[str, Any] = {
        "include": str(builtin_yaml),
        "task": task,
        "dataset_path": _BUILDERS.get(data_file.suffix.lower(), "json"),
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: str(data_file)}},
        # The file holds only the evaluation split; few-shot examples, if asked for, then come
        # from it too (lm-eval excludes the document being scored).
        "training_split": None,
        "fewshot_split": None,
    }
    if base.get("test_split"):
        cfg["test_split"], cfg["validation_split"] = split, None
    else:
        cfg["validation_split"] = split
    return cfg


def prepare_tasks(cfg: EvalConfig) -> TaskSetup:
    """Validate ``cfg.tasks`` / ``cfg.local_data`` and build the TaskManager. No model needed."""
    from lm_eval.tasks import TaskManager

    names = expand_tasks(list(cfg.tasks))
    local = _resolve_local(dict(cfg.local_data or {}))
    include: list[str] = [cfg.include_path] if cfg.include_path else []
    for p in include:
        if not Path(p).is_dir():
            raise TaskConfigError(f"eval.include_path={p} is not a directory")
    # The full built-in index is only needed for a task we cannot place without it.
    need_defaults = any(n not in local for n in names)
    index = None
    builtin: dict[str, Path] = {}
    for task in local:
        known = _KNOWN_YAML.get(task)
        if known and (_builtin_dir() / known).is_file():
            builtin[task] = _builtin_dir() / known
            continue
        index = index if index is not None else _builtin_index()
        entry = index.get(task)
        if entry is None or entry.yaml_path is None:
            raise _unknown_error([task], sorted(index))
        if entry.kind.name != "TASK":
            raise TaskConfigError(f"eval.local_data.{task}: {task} is a lm-eval {entry.kind.name.lower()}, "
                                  "not a single task; give a file per task it contains")
        builtin[task] = Path(entry.yaml_path)
    tmp = None
    if local:
        tmp = tempfile.TemporaryDirectory(prefix="scape_eval_tasks_")
        for task, data_file in local.items():
            text = yaml.safe_dump(_local_yaml(task, builtin[task], data_file), sort_keys=False)
            (Path(tmp.name) / f"{task}.yaml").write_text(text)
        include.append(tmp.name)
    try:
        manager = TaskManager(include_path=include or None, include_defaults=need_defaults)
        unknown = [n for n in names if n not in manager.all_tasks]
        if unknown:
            known = manager.all_tasks if need_defaults else sorted(index or _builtin_index())
            raise _unknown_error(unknown, known)
    except BaseException:
        if tmp is not None:
            tmp.cleanup()
        raise
    return TaskSetup(names=names, manager=manager, local=local, _tmp=tmp)


# -- loading (downloads happen here) -----------------------------------------------------------

def _hub_reachable() -> bool:
    from scape_train.data.hub import hub_problem

    return hub_problem() is None     # one probe per process, shared with the start-up check


@contextlib.contextmanager
def _offline_unless_reachable(needed: bool) -> Iterator[None]:
    """Without a reachable hub, datasets retries for ~23 s before failing; switching it to offline
    mode makes a cached dataset load at once and a missing one fail at once."""
    if not needed or _hub_reachable():
        yield
        return
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _is_unreachable(exc: BaseException) -> bool:
    """Does this exception (or one it wraps) say the dataset could not be fetched?"""
    words = ("offline", "connection", "couldn't reach", "could not reach", "not find", "doesn't exist",
             "unreachable", "cannot find", "no such")
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, OSError, FileNotFoundError)):
            return True
        name = type(exc).__name__
        if name in ("DatasetNotFoundError", "OfflineModeIsEnabled", "LocalEntryNotFoundError",
                    "HfHubHTTPError", "DataFilesNotFoundError", "EmptyDatasetError"):
            return True
        if any(w in str(exc).lower() for w in words):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def load_tasks(setup: TaskSetup) -> list[Any]:
    """Build every task (this reads its data); a dataset that cannot be read names the task."""
    objects = []
    hub_needed = any(n not in setup.local for n in setup.names)
    with _offline_unless_reachable(hub_needed):
        for name in setup.names:
            try:
                loaded = setup.manager.load([name])
            except Exception as exc:
                if not _is_unreachable(exc):
                    raise
                where = (f"its local file {setup.local[name]}" if name in setup.local
                         else "the Hugging Face Hub (offline or unreachable, and not in the local "
                              "datasets cache)")
                raise TaskDataUnavailableError(
                    f"lm-eval task {name!r}: its data could not be read from {where}: "
                    f"{type(exc).__name__}: {exc}. To run it offline, download the task's evaluation "
                    f"split once and set eval.local_data.{name}=/abs/path/to/{name}.jsonl (same task "
                    "definition, data read from the file).") from exc
            groups = loaded.get("groups") or {}
            if name in groups:          # a group (e.g. mmlu) keeps its aggregate score
                objects.append(groups[name])
            else:                       # a task, or a tag's tasks
                objects.extend(loaded["tasks"].values())
    return objects
