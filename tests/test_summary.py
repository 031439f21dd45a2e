"""The start-up summary (rank 0, once; W&B config/summary) and the optimizer-aware progress bar."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from scape_train.metrics import MetricsLogger, bar_fields
from scape_train.summary import format_summary, startup_summary
from tests import _fault_job as fj
from tests._dist import run_distributed
from tests.helpers import SMALL, compose_config


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return fj.tok_cache(tmp_path_factory)


def job(root, tok, *extra):
    return compose_config(SMALL + [f"run_dir={root}/run", f"data.tokenizer.cache_dir={tok}",
                                   "trainer.sample_tokens=0", *extra])


def test_summary_figures_and_wandb(tmp_path, tok, capsys, monkeypatch):
    from scape_train.train import Trainer

    monkeypatch.delenv("WANDB_MODE", raising=False)   # conftest disables W&B; offline writes here

    cfg = job(tmp_path, tok, "trainer.max_steps=4", "optimizer=scape", "optimizer.density=0.05",
              "optimizer.density_warmup_steps=3", "trainer.global_batch_size=8",
              "logging.wandb.mode=offline")
    trainer = Trainer(cfg)
    s = startup_summary(trainer)
    assert s["params"] == trainer.model.num_params() and s["world_size"] == 1
    assert s["grad_accum"] == 2 and s["tokens_per_step"] == 4 * 2 * 64
    assert s["precision"] == "fp32" and s["devices"].startswith("cpu x 1")
    assert s["density"].startswith("geometric from 1.0 to 0.05 (95% sparse) over 3 steps")
    assert "scape, lr 0.003" in s["optimizer"] and s["run_dir"] == str(tmp_path / "run")
    assert "strategy" not in s
    assert s["memory_plan"] == trainer.memory_plan.verdict() and s["memory_plan"].endswith("fits")
    assert s["attention"] == "flash_attention (trainer.attention_backend=auto)"   # the CPU's

    trainer.fit()
    out = capsys.readouterr().out
    assert out.count("scape_train: ") == 1
    assert "4 seqs x 64 tokens x 2 accumulation x 1 ranks = 512 tokens/step" in out
    assert f"run dir     {tmp_path / 'run'}" in out
    assert "attention   flash_attention (trainer.attention_backend=auto)" in out
    # recorded in the offline W&B run (config key `startup`, summary keys `startup/*`)
    # (W&B's service may still be flushing the file when finish() returns: wait for it)
    (record,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while b"startup/params" not in record.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)
    blob = record.read_bytes()
    assert b"startup" in blob and b"tokens_per_step" in blob and b"startup/params" in blob


def test_report_startup_records_in_the_wandb_run(tmp_path, tok, capsys):
    from scape_train.summary import report_startup
    from scape_train.train import Trainer

    class Config(dict):
        def update(self, values, allow_val_change=False):
            super().update(values)

    class FakeRun:
        def __init__(self):
            self.config, self.summary = Config(), {}

    trainer = Trainer(job(tmp_path, tok, "trainer.max_steps=2", "logging.wandb.mode=disabled"))
    run = FakeRun()
    s = report_startup(trainer, run)
    trainer.train_loader.close()
    assert run.config["startup"] == s and run.summary["startup/params"] == s["params"]
    assert capsys.readouterr().out.startswith("scape_train: ")


def test_local_strategy_line(tmp_path, tok):
    from scape_train.train import Trainer

    trainer = Trainer(job(tmp_path, tok, "trainer.max_steps=8", "strategy=diloco",
                          "strategy.inner_steps=4", "logging.wandb.mode=disabled"))
    s = startup_summary(trainer)
    assert s["strategy"].startswith("diloco, H=4, ~2 rounds, topology complete")
    assert "density" not in s
    trainer.train_loader.close()
    assert "strategy    diloco" in format_summary(s)


def test_sparseloco_strategy_line_says_what_it_sends():
    from scape_train.summary import _strategy_line
    from tests.helpers import compose_config

    cfg = compose_config(["strategy=sparseloco", "optimizer=adamw",
                          "strategy.sparse_payload_dtype=fp8_e4m3"])
    line = _strategy_line(cfg)
    assert line.startswith("sparseloco, H=30") and "outer lr 1, momentum 0" in line
    assert line.endswith("top 64 of every 4096 values of its error feedback (decay 0.95) as fp8_e4m3")


def _ddp(rank, world, root, tok):
    from scape_train.train import run

    run(job(root, tok, "trainer.max_steps=2", "trainer.global_batch_size=16", "logging.wandb.mode=disabled"))


@pytest.mark.slow
def test_printed_once_by_rank_zero(tmp_path, tok, capfd):
    run_distributed(_ddp, 2, (str(tmp_path), tok))
    out = capfd.readouterr().out
    assert out.count("scape_train: ") == 1
    assert "cpu x 2 (world size 2)" in out and "x 2 accumulation x 2 ranks" in out


def test_progress_bar_shows_what_matters_for_the_optimizer(tmp_path):
    scape = bar_fields({"loss": 3.0, "scape/density": 0.05, "comm/sent_bytes": 2.5e6, "mfu": 0.1})
    assert scape == {"loss": "3", "density": "0.05", "MB/step": "2.5", "mfu": "0.1"}
    assert bar_fields({"loss": 3.0, "outer/round": 7.0})["round"] == "7"
    assert "MB/step" not in bar_fields({"comm/sent_bytes": 0.0})
    logger = MetricsLogger(Path(tmp_path), True, 10, True)
    logger.log(1, {"loss": 2.0, "scape/density": 0.5, "comm/sent_bytes": 1e6})
    logger.log(1, {"val_loss": 2.5})            # the step's other fields stay on the bar
    assert logger.bar.postfix == "loss=2, density=0.5, MB/step=1, val_loss=2.5"
    logger.close()


def test_elastic_strategy_lines_name_the_lighthouse_and_the_round():
    from scape_train.summary import _strategy_line
    from tests.helpers import compose_config

    elastic = ["strategy.elastic.enabled=true", "strategy.elastic.slots=3",
               "strategy.elastic.replica=1", "strategy.elastic.lighthouse=http://lh:29510"]
    dp = _strategy_line(compose_config(["optimizer=adamw", *elastic]))
    assert dp.startswith("data_parallel across torchft replica groups, every step a round")
    assert "optimizer adamw" in dp and "replica 1 of 3 slots, lighthouse http://lh:29510" in dp
    assert "the gradients' all-reduce" in dp
    scape = _strategy_line(compose_config(["optimizer=scape", *elastic]))
    assert "SCAPE's payload all-reduce and next-mask all-gather" in scape
    local = _strategy_line(compose_config(["strategy=diloco", "optimizer=adamw", *elastic]))
    assert local.startswith("diloco, H=") and "replica 1 of 3 slots" in local
    assert _strategy_line(compose_config(["optimizer=adamw"])) is None
