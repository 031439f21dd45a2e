"""``+experiment=NAME +smoke=cpu``: every paper experiment runs end to end, shrunk, on CPU, offline.

The config test (fast) checks what the overlay keeps and how it scales; the end-to-end test runs
each paper experiment (``configs/experiment/``, not ``tiny_*``) to its end, evaluation included,
on the world size it needs: GASLoC-2peer on 3 ranks (a real ring), 1peer / DiLoCo / SCAPE on 2
(real exchanges), dense data-parallel on 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scape_train.config import validate
from scape_train.smoke import apply_smoke
from tests._dist import run_distributed
from tests.helpers import CONFIG_DIR, compose_config

PAPER = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml")
               if not p.stem.startswith("tiny_"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One tokenizer (trained once on the shipped text) and one cloze file for every test here."""
    return str(tmp_path_factory.mktemp("smoke_cache"))


def overrides(name: str, root, cache, *extra: str) -> list[str]:
    return [f"+experiment={name}", "+smoke=cpu", f"run_dir={Path(root) / name}",
            f"data.tokenizer.cache_dir={Path(cache) / 'tok'}", f"smoke.cache_dir={Path(cache) / 'smoke'}",
            "logging.progress_bar=false", "trainer.num_threads=1", *extra]


def world_for(cfg) -> int:
    s = cfg.strategy
    if s.name == "gasloc" and s.topology == "2peer":
        return 3
    if s.name != "data_parallel" or cfg.optimizer.name in ("scape", "topk_adamw", "powersgd"):
        return 2
    return 1


def test_paper_experiments_list():
    assert len(PAPER) >= 19 and "llama500m_s99" in PAPER and "gasloc_134m_h30" in PAPER


@pytest.mark.parametrize("name", PAPER)
def test_overlay_keeps_the_experiment_and_scales_its_warmups(name, tmp_path, cache):
    exp = compose_config([f"+experiment={name}"])
    raw = compose_config(overrides(name, tmp_path, cache))
    world = world_for(raw)
    cfg = apply_smoke(raw, world)
    validate(cfg, world)
    o, t, m = cfg.optimizer, cfg.trainer, cfg.model
    # kept: the optimizer, strategy, schedule kind, architecture, evaluation wiring
    for key in ("name", "lr", "min_lr", "betas", "weight_decay", "clip_grad", "density",
                "density_schedule", "sharded", "partitioner", "offload_residuals", "bias_correction"):
        assert getattr(o, key) == getattr(exp.optimizer, key), key
    for key in ("name", "topology", "outer_lr", "outer_momentum", "mix_momentum"):
        assert getattr(cfg.strategy, key) == getattr(exp.strategy, key), key
    assert (cfg.strategy.round_budget_s > 0) == (exp.strategy.round_budget_s > 0)
    assert t.lr_schedule == exp.trainer.lr_schedule
    assert t.activation_checkpointing == exp.trainer.activation_checkpointing
    for key in ("arch", "tie_embeddings", "bias", "vocab_pad_multiple", "rope_theta"):
        assert getattr(m, key) == getattr(exp.model, key), key
    gqa = (exp.model.n_kv_heads or exp.model.n_heads) < exp.model.n_heads
    assert ((m.n_kv_heads or m.n_heads) < m.n_heads) == gqa
    assert cfg.eval.enabled == exp.eval.enabled and cfg.eval.tasks == exp.eval.tasks
    # shrunk, offline, W&B offline
    assert m.n_layers == 2 and m.d_model == 64 and cfg.data.seq_len == 64 <= m.max_seq_len
    assert cfg.data.source == "classics" and cfg.data.tokenizer.kind == "trained_bpe"
    assert t.device == "cpu" and cfg.logging.wandb.mode == "offline"
    assert cfg.run_name == f"{exp.run_name}_smoke" and "smoke" in cfg.logging.wandb.tags
    assert t.max_steps <= 32 and t.micro_batch_size == 2
    if exp.trainer.global_batch_size:
        assert t.global_batch_size == 2 * world * 2     # accumulation kept, capped at 2
    # warm-ups at the same fraction of the run (to the nearest step, at least 1)
    for got, was in ((t.warmup_steps, exp.trainer.warmup_steps),
                     (o.density_warmup_steps, exp.optimizer.density_warmup_steps)):
        assert got == (0 if was == 0 else max(1, round(was / exp.trainer.max_steps * t.max_steps)))
    if cfg.strategy.name != "data_parallel":
        h = cfg.strategy.inner_steps
        assert h == min(exp.strategy.inner_steps, 4) and t.max_steps % max(h, 1) == 0
    # the experiment itself is untouched by apply_smoke (a copy)
    assert raw.model.n_layers == exp.model.n_layers and raw.trainer.max_steps == exp.trainer.max_steps


def _smoke_jobs(rank, world, names, root, cache):
    """Every experiment of one world size, one after the other in the same processes (one spawn
    for all of them: starting processes costs more than a smoke run)."""
    from scape_train.train import run

    out = {}
    for name in names:
        try:
            summary = run(compose_config(overrides(name, root, cache, "logging.wandb.mode=disabled")))
        except Exception as exc:
            raise RuntimeError(f"the smoke run of +experiment={name} failed on rank {rank}") from exc
        out[name] = {k: summary.get(k) for k in ("step", "val_loss", "checkpoint", "downstream",
                                                 "stopped_early")}
    return out


def _world_of(name: str, root, cache: str) -> int:
    return world_for(compose_config(overrides(name, root, cache)))


def _by_world(root: Path, cache: str) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for name in PAPER:
        groups.setdefault(_world_of(name, root, cache), []).append(name)
    return groups


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"{w}rank")
def test_every_paper_experiment_runs_to_its_end(world, tmp_path, cache):
    """~1 minute per world size on 2 CPU cores (the 2- and 3-rank groups run 8 and 6 experiments)."""
    run_and_check(world, _by_world(tmp_path, cache).get(world, []), tmp_path, cache)


# Not slow: one experiment of a kind the slow test groups by world, beside the SCAPE Llama run of
# test_one_experiment_end_to_end: GPT with dense AdamS on one process, GASLoC (Llama, AdamW inner
# steps) on 2 real ranks.
REPRESENTATIVE = {1: ["gpt345m_adams"], 2: ["gasloc_1peer_134m_h30"]}


@pytest.mark.parametrize("world", sorted(REPRESENTATIVE), ids=lambda w: f"{w}rank")
def test_one_experiment_per_world_runs_to_its_end(world, tmp_path, cache):
    names = REPRESENTATIVE[world]
    assert all(_world_of(name, tmp_path, cache) == world for name in names)
    run_and_check(world, names, tmp_path, cache)


def run_and_check(world: int, names: list[str], tmp_path: Path, cache: str) -> None:
    assert names
    if world == 1:
        results = _smoke_jobs(0, 1, names, str(tmp_path), cache)
    else:
        results = run_distributed(_smoke_jobs, world, (names, str(tmp_path), cache))[0]
    for name in names:
        check_run(name, world, tmp_path, cache, results[name])


def check_run(name: str, world: int, root: Path, cache: str, first: dict) -> None:
    cfg = apply_smoke(compose_config(overrides(name, root, cache)), world)
    assert not first["stopped_early"], name
    # named by the step all ranks agree on (local-step strategies: rounds x H; with a wall-clock
    # round budget a worker's own step count can be lower)
    assert first["checkpoint"].endswith(f"step_{cfg.trainer.max_steps:08d}"), name
    if cfg.strategy.round_budget_s == 0:
        assert first["step"] == cfg.trainer.max_steps, name
    assert first["val_loss"] == first["val_loss"], name   # finite, agreed
    run_dir = root / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum("val_loss" in r for r in rows) >= 2, name  # mid-run validation and the final one
    if cfg.optimizer.name == "scape":
        assert any(0 < r.get("scape/density", 1) < 1 for r in rows), name
        if world > 1:
            assert any(r.get("comm/payload_sent_bytes", 0) > 0 for r in rows), name
    if cfg.strategy.name != "data_parallel":
        assert any(r.get("outer/round", 0) >= 2 for r in rows), name
    if cfg.eval.enabled:
        final = json.loads((run_dir / "eval" / "results_final.json").read_text())
        assert "lambada_openai" in final["results"], name
        assert first["downstream"]["lambada_openai/sample_len"] == cfg.eval.limit, name


def test_one_experiment_end_to_end(tmp_path, capsys, cache):
    """Not slow: the SCAPE 99% Llama-500M experiment on one process, evaluation included."""
    name = "llama500m_s99"
    results = _smoke_jobs(0, 1, [name], str(tmp_path), cache)
    check_run(name, 1, tmp_path, cache, results[name])
    out = capsys.readouterr().out
    assert "scape_train: llama500m_smoke" in out and "over 2 steps" in out
