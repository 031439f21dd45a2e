"""End of training and the standalone entry give the same downstream numbers on the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compose_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_end_of_training_equals_standalone(shared_data, tmp_path):
    from scape_train.train import run

    run_dir = tmp_path / "run"
    lambada = shared_data / "eval" / "lambada_openai" / "lambada_test.jsonl"
    cfg = compose_config([
        "model=llama_tiny", "trainer.max_steps=4", "trainer.warmup_steps=1", "trainer.log_every=2",
        "trainer.micro_batch_size=2", "trainer.eval_batches=1", "trainer.device=cpu",
        "data.val_tokens=2048", "logging.wandb.mode=disabled", "logging.progress_bar=false",
        f"run_dir={run_dir}", "eval=lambada_local", "eval.limit=20", "eval.bootstrap_iters=0",
        f"eval.local_data.lambada_openai={lambada}",
    ])
    summary = run(cfg)
    trained = summary["downstream"]
    assert trained["lambada_openai/sample_len"] == 20
    final = json.loads((run_dir / "eval" / "results_final.json").read_text())

    env = {**os.environ, "SCAPE_SHARED_DATA": str(shared_data)}
    proc = subprocess.run(
        [sys.executable, "-m", "scape_train.eval", f"checkpoint={run_dir}", "eval=lambada_local",
         "eval.limit=20", "eval.bootstrap_iters=0", "device=cpu"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted((run_dir / "eval").glob("results_step*.json"))
    assert len(results) == 1, results
    standalone = json.loads(results[0].read_text())
    for metric in ("acc,none", "perplexity,none"):
        assert standalone["results"]["lambada_openai"][metric] == pytest.approx(
            final["results"]["lambada_openai"][metric], rel=1e-6)
