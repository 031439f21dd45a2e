"""``evaluate_downstream``: lm-eval on an in-memory model, results to disk, console and W&B.

Called by the trainer at the end of a run (every rank: the evaluator splits the documents across
ranks and rank 0 gathers the scores) and by ``python -m scape_train.eval``. Writes
``<run_dir>/eval/results_<tag>.json`` (lm-eval's results dict) on rank 0 and returns the flat
metrics (``{"lambada_openai/acc": ..., ...}``) on every rank.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from scape_train.distributed import DistInfo, broadcast_object
from scape_train.eval.config import EvalConfig
from scape_train.eval.tasks import TaskSetup, load_tasks, prepare_tasks

log = logging.getLogger(__name__)


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``{"task/metric": value}`` from lm-eval's results (filter suffixes like ",none" dropped)."""
    out: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for key, value in metrics.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool) or key == "alias":
                    continue
                metric, _, filt = key.partition(",")
                name = metric if filt in ("", "none") else f"{metric}[{filt}]"
                out[f"{task}/{name}"] = float(value)
    return out


def _limit(cfg: EvalConfig) -> int | float | None:
    if cfg.limit is None:
        return None
    return int(cfg.limit) if cfg.limit >= 1 else float(cfg.limit)


def run_lm_eval(lm: Any, cfg: EvalConfig, setup: TaskSetup) -> dict[str, Any] | None:
    """lm-eval's simple_evaluate on ``lm`` (an lm_eval LM) with prepared tasks; rank 0 gets results."""
    from lm_eval import simple_evaluate

    tasks = load_tasks(setup)
    return simple_evaluate(
        model=lm, tasks=tasks, task_manager=setup.manager, num_fewshot=cfg.num_fewshot or None,
        limit=_limit(cfg), bootstrap_iters=cfg.bootstrap_iters, log_samples=cfg.log_samples,
        random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed)


def write_results(results: dict[str, Any], out_dir: Path, tag: str) -> Path:
    from lm_eval.utils import handle_non_serializable

    out_dir.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples", None)
    path = out_dir / f"results_{tag}.json"
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    if samples:
        with open(out_dir / f"samples_{tag}.jsonl", "w") as f:
            for task, rows in samples.items():
                for row in rows:
                    f.write(json.dumps({"task": task, **row}, default=handle_non_serializable,
                                       ensure_ascii=False) + "\n")
    return path


def report(results: dict[str, Any], path: Path, wandb_run: Any = None, step: int | None = None) -> None:
    """Console table (lm-eval's) and, when a W&B run is given, a table plus summary values."""
    from lm_eval.utils import make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    print(f"downstream results: {path}")
    if wandb_run is None:
        return
    import wandb

    flat = flat_metrics(results)
    table = wandb.Table(columns=["task", "metric", "value"],
                        data=[[*k.split("/", 1), v] for k, v in flat.items()])
    payload = {"downstream/results": table, **{f"downstream/{k}": v for k, v in flat.items()}}
    wandb_run.log(payload, **({"step": step} if step is not None else {}))
    wandb_run.summary.update({f"downstream/{k}": v for k, v in flat.items() if math.isfinite(v)})


def evaluate_downstream(model: torch.nn.Module, tokenizer: Any, cfg: EvalConfig, run_dir: str | Path,
                        info: DistInfo | None = None, wandb_run: Any = None, step: int | None = None,
                        setup: TaskSetup | None = None) -> dict[str, float]:
    """Evaluate ``model`` on ``cfg.tasks``; collective under torchrun (every rank calls it).

    ``step`` names the results file (``results_step00000400.json``; None: ``results_final.json``).
    ``setup`` is an already prepared task set (the standalone entry validates before loading the
    model); by default the tasks are prepared here.
    """
    from scape_train.eval.adapter import ScapeLM

    info = info or DistInfo()
    start = time.perf_counter()
    own_setup = setup is None
    setup = setup or prepare_tasks(cfg)
    try:
        lm = ScapeLM(model, tokenizer, batch_size=cfg.batch_size, max_length=cfg.max_length,
                     max_gen_toks=cfg.max_gen_toks, precision=cfg.precision)
        results = run_lm_eval(lm, cfg, setup)
    finally:
        if own_setup:
            setup.close()
    flat: dict[str, float] = {}
    if info.is_main and results is not None:
        tag = "final" if step is None else f"step{step:08d}"
        path = write_results(results, Path(run_dir) / "eval", tag)
        report(results, path, wandb_run, step)
        flat = flat_metrics(results)
        log.info("downstream evaluation of %s took %.1fs", ", ".join(setup.names),
                 time.perf_counter() - start)
    return broadcast_object(flat, info)
