"""``python -m scape_train.eval checkpoint=PATH [eval.tasks=[...]] [eval.local_data.TASK=FILE] ...``

Evaluates a checkpoint (a checkpoint directory, or a run directory: its newest valid checkpoint)
with the same adapter the trainer uses, or a Hugging Face export with ``hf=PATH`` through
lm-eval's own ``hf`` model. Task names and local data are validated before any model is loaded.
Results go to ``<run_dir>/eval/results_step<N>.json`` (``<hf dir>/eval/results_hf.json``), or
under ``out_dir=...``. Runs under torchrun too (the documents are split across ranks).

Examples:
    python -m scape_train.eval checkpoint=outputs/default/20260101-120000 eval=lambada_local
    python -m scape_train.eval hf=exports/llama_tiny eval=paper eval.limit=100
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from scape_train.eval.config import EvalConfig

log = logging.getLogger("scape_train.eval")


@dataclass
class EvalAppConfig:
    checkpoint: Optional[str] = None  # checkpoint dir or run dir
    hf: Optional[str] = None          # a transformers save_pretrained dir (e.g. from export_hf)
    device: str = "auto"              # auto | cpu | cuda
    out_dir: Optional[str] = None     # default: the run dir (checkpoint) or the hf dir
    eval: EvalConfig = field(default_factory=EvalConfig)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="eval_app_schema", node=EvalAppConfig)   # types eval: too (no fake eval=schema)


def _evaluate_hf(app: EvalAppConfig, setup: Any, info: Any) -> tuple[dict, Path, str]:
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from scape_train.eval.runner import run_lm_eval

    path = Path(app.hf).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"hf={app.hf}: no config.json there; give a save_pretrained directory")
    eos = AutoTokenizer.from_pretrained(str(path)).eos_token_id
    # EOS as the empty-context prefix, as in training (documents are separated by EOS) and in
    # the in-tree adapter; HFLM would otherwise prefer BOS where the tokenizer has one.
    lm = HFLM(pretrained=str(path), tokenizer=str(path), batch_size=app.eval.batch_size,
              max_length=app.eval.max_length or None, device=str(info.device),
              dtype="float32" if app.eval.precision == "fp32" else "bfloat16", prefix_token_id=eos)
    return run_lm_eval(lm, app.eval, setup), path, "hf"


def run(app: EvalAppConfig) -> dict[str, float]:
    """Validate tasks, load the model, evaluate; returns the flat metrics (all ranks)."""
    from scape_train import distributed as D
    from scape_train.eval.loading import load_checkpoint
    from scape_train.eval.runner import evaluate_downstream, flat_metrics, report, write_results
    from scape_train.eval.tasks import prepare_tasks

    if bool(app.checkpoint) == bool(app.hf):
        raise ValueError("give exactly one of checkpoint=<checkpoint or run dir> or hf=<export dir>")
    setup = prepare_tasks(app.eval)          # before the model: a typo costs seconds, not a load
    info = D.init_distributed(app.device)
    try:
        if app.hf:
            results, base, tag = _evaluate_hf(app, setup, info)
            flat = {}
            if info.is_main and results is not None:
                out = write_results(results, Path(app.out_dir or base) / "eval", tag)
                report(results, out)
                flat = flat_metrics(results)
            return D.broadcast_object(flat, info)
        model, tokenizer, ckpt, manifest = load_checkpoint(app.checkpoint, info.device)
        log.info("evaluating %s (step %s)", ckpt, manifest.get("step"))
        run_dir = Path(app.out_dir) if app.out_dir else ckpt.parent.parent
        return evaluate_downstream(model, tokenizer, app.eval, run_dir, info, None,
                                   step=int(manifest.get("step", 0)), setup=setup)
    finally:
        setup.close()
        D.shutdown(info)


def _user_errors() -> tuple[type[BaseException], ...]:
    from scape_train.checkpoint import CheckpointError

    return (CheckpointError, ValueError, FileNotFoundError, ConnectionError)


register_configs()


@hydra.main(version_base="1.3", config_path="../configs", config_name="eval_app")
def _hydra_main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app: EvalAppConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    try:
        run(app)
    except _user_errors() as exc:
        if os.environ.get("SCAPE_TRACEBACK") == "1":
            raise
        print(f"\nscape_train.eval: error: {exc}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
