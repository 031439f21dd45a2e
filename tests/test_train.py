"""End-to-end trainer tests on the real stack: Hydra config, data, model, optimizer, checkpoints."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from scape_train.checkpoint import CheckpointError, CheckpointManager
from scape_train.train import NonFiniteLossError, run
from tests import _fault_job as fj
from tests._dist import run_distributed
from tests.helpers import (SMALL, assert_same_record, compose_config, total_sent_bytes,
                           wandb_config_keys, wandb_history)



@pytest.fixture(scope="module")
def tok_cache(tmp_path_factory):
    return fj.tok_cache(tmp_path_factory)


def job(run_dir, tok_cache, *extra):
    return compose_config(SMALL + [f"run_dir={run_dir}", f"data.tokenizer.cache_dir={tok_cache}",
                                   *extra])


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def final_model(run_dir: Path) -> dict:
    mgr = CheckpointManager(Path(run_dir) / "checkpoints", None)
    return torch.load(mgr.latest_valid() / "model.pt", weights_only=True)


def test_exact_resume_bit_for_bit(tmp_path, tok_cache):
    """2N steps == N steps, stop, resume, N more: losses and final parameters identical."""
    straight, sliced = tmp_path / "straight", tmp_path / "sliced"
    run(job(straight, tok_cache, "trainer.max_steps=8", "trainer.checkpoint_every=0"))
    first = run(job(sliced, tok_cache, "trainer.max_steps=8", "trainer.stop_after=4"))
    assert first["step"] == 4 and first["stopped_early"]
    second = run(job(sliced, tok_cache, "trainer.max_steps=8", "resume=auto"))
    assert second["step"] == 8
    assert losses(straight) == losses(sliced)
    assert_same_record(straight, sliced)   # every logged column but the clock's
    a, b = final_model(straight), final_model(sliced)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_default_style_job_learns_and_writes_outputs(tmp_path, tok_cache):
    summary = run(job(tmp_path, tok_cache, "trainer.max_steps=40", "trainer.eval_every=20",
                      "trainer.log_every=5"))
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 2 and vals[-1] < vals[0] < math.log(1024) + 0.5
    logged = next(r for r in rows if "tokens_per_s" in r)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "time/data_s", "time/fwd_bwd_s",
                "time/optimizer_s", "step_time_s"):
        assert key in logged, key
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "tokenizer").is_dir()
    assert Path(summary["checkpoint"]).name == "step_00000040"


def test_refuses_to_overwrite_and_checks_shape_on_resume(tmp_path, tok_cache):
    run(job(tmp_path, tok_cache, "trainer.max_steps=2"))
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        run(job(tmp_path, tok_cache, "trainer.max_steps=4"))
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="another model shape"):
        run(job(tmp_path, tok_cache, "trainer.max_steps=4", "resume=auto", "model.d_model=128"))
    with pytest.raises(CheckpointError, match="another tokenizer"):
        run(job(tmp_path, tok_cache, "trainer.max_steps=4", "resume=auto",
                "data.tokenizer.vocab_size=512"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_nonfinite_loss_stops_naming_the_step(tmp_path, tok_cache):
    # lr = 1e30 blows the weights up within a few steps; the message names the step and the
    # last good checkpoint, which stays loadable.
    with pytest.raises(NonFiniteLossError, match=r"non-finite (loss .* at step|parameters after step) \d+") as err:
        run(job(tmp_path, tok_cache, "trainer.max_steps=30", "trainer.checkpoint_every=1",
                "optimizer.lr=1e30", "optimizer.min_lr=0", "optimizer.clip_grad=0",
                "trainer.warmup_steps=0"))
    assert "step_0000" in str(err.value)
    mgr = CheckpointManager(tmp_path / "checkpoints", None)
    state = torch.load(mgr.latest_valid() / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values())


def _ddp_job(rank, world, run_dir, tok_cache):
    summary = run(job(run_dir, tok_cache, "trainer.max_steps=4", "trainer.global_batch_size=16"))
    return summary["step"], summary["val_loss"], summary["run_dir"]


def test_ddp_two_ranks_one_run_dir(tmp_path, tok_cache):
    # global batch 16 = micro 4 x 2 ranks x 2 accumulation steps
    results = run_distributed(_ddp_job, 2, (str(tmp_path), tok_cache))
    assert results[0] == results[1]
    assert results[0][0] == 4
    assert (tmp_path / "metrics.jsonl").exists()
    ckpt = CheckpointManager(tmp_path / "checkpoints", None).latest_valid()
    # replicated state (model, optimizer under DDP, counters) once, per-rank state by each rank
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "model.pt", "rank_00000.pt",
                                                      "rank_00001.pt", "replicated.pt"]


def test_wandb_offline_logs_config_and_resumes_same_run(tmp_path, tok_cache):
    """W&B offline: the run id is saved in the checkpoint and reused on resume, and a resumed run
    continues one record: after a crash past the last checkpoint (steps 4-6 logged, checkpoint
    3), metrics.jsonl and the one offline W&B directory hold each step once."""
    import shutil

    args = ["trainer.max_steps=6", "trainer.checkpoint_every=3", "logging.wandb.mode=offline"]
    run(job(tmp_path, tok_cache, *args))
    mgr = CheckpointManager(tmp_path / "checkpoints", None)
    shutil.rmtree(mgr.latest_valid())                 # the crash: step 6 was never saved
    run_id = json.loads((mgr.latest_valid() / "manifest.json").read_text())["meta"]["wandb_run_id"]
    assert len(run_id) == 8 and mgr.latest_valid().name == "step_00000003"
    first = losses(tmp_path)
    run(job(tmp_path, tok_cache, *args, "resume=auto"))
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "loss" in r]
    assert train_steps == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "val_loss" in r] == [6]
    assert losses(tmp_path) == first                  # the replayed steps, bit for bit
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # W&B names the directory offline-run-<time>-<id>, adding -1, -2... when a run of that id
    # started in the same second (a fast resume)
    assert len(runs) == 1 and re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?",
                                           runs[0].name), runs
    history = wandb_history(runs[0])
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert {h["_step"]: h["loss"] for h in history} == first
    assert history[-1]["val_loss"] == rows[-1]["val_loss"]
    assert {"model", "optimizer", "trainer"} <= wandb_config_keys(runs[0])
    final = json.loads((mgr.latest_valid() / "manifest.json").read_text())["meta"]
    assert final["wandb_run_id"] == run_id


def _scape_resume_job(rank, world, root, tok_cache, extra):
    scape = ["optimizer=scape", "optimizer.density=0.05", "optimizer.density_warmup_steps=3", *extra]
    run(job(f"{root}/straight", tok_cache, "trainer.max_steps=6", "trainer.checkpoint_every=0", *scape))
    run(job(f"{root}/sliced", tok_cache, "trainer.max_steps=6", "trainer.stop_after=3", *scape))
    run(job(f"{root}/sliced", tok_cache, "trainer.max_steps=6", "resume=auto", *scape))
    return True


@pytest.mark.parametrize("extra", [
    pytest.param([], marks=pytest.mark.slow),
    pytest.param(["optimizer.sharded=true", "optimizer.partitioner=flat"], marks=pytest.mark.slow),
    # the wire format's owner-range update residual goes through the checkpoint's shard files
    # ... and the schedule's phases: a dense step, a linear ramp, the resume, a cooldown
    ["optimizer.sharded=true", "optimizer.partitioner=flat", "optimizer.payload_dtype=bf16",
     "optimizer.mask_coding=indices", "optimizer.density_schedule=linear",
     "optimizer.density_start_step=2", "optimizer.density_cooldown_steps=2"]],
    ids=["replicated", "sharded", "sharded-bf16-indices-phases"])
def test_scape_two_ranks_exact_resume(tmp_path, tok_cache, extra):
    """A 2-rank SCAPE run: 2N steps == N + resume + N, bit for bit (losses and parameters)."""
    run_distributed(_scape_resume_job, 2, (str(tmp_path), tok_cache, extra))
    assert losses(tmp_path / "straight") == losses(tmp_path / "sliced")
    a, b = final_model(tmp_path / "straight"), final_model(tmp_path / "sliced")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(l) for l in (tmp_path / "sliced" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("comm/payload_sent_bytes", 0) > 0 for r in rows)
    assert any(0 < r.get("scape/density", 1) < 1 for r in rows)
    # every logged column but the clock's, the run's total bytes included, survives the resume
    assert_same_record(tmp_path / "straight", tmp_path / "sliced")
    assert total_sent_bytes(tmp_path / "sliced") > 0


def test_activation_checkpointing_and_bf16_autocast_train(tmp_path, tok_cache):
    """Recomputing blocks in backward changes no number; bf16 autocast trains close to fp32."""
    plain = run(job(tmp_path / "plain", tok_cache, "trainer.max_steps=3"))
    ac = run(job(tmp_path / "ac", tok_cache, "trainer.max_steps=3",
                 "trainer.activation_checkpointing=true"))
    assert losses(tmp_path / "plain") == losses(tmp_path / "ac")
    assert plain["val_loss"] == ac["val_loss"]
    bf16 = run(job(tmp_path / "bf16", tok_cache, "trainer.max_steps=3", "trainer.precision=bf16"))
    assert abs(bf16["val_loss"] - plain["val_loss"]) < 0.05
    keys = final_model(tmp_path / "ac").keys()
    assert keys == final_model(tmp_path / "plain").keys()  # parameter names unchanged by AC


def test_compile_with_activation_checkpointing_trains_in_bf16(tmp_path, tok_cache):
    """torch.compile and activation checkpointing together (the shipped 500M presets on a GPU):
    each block is checkpointed, then compiled; the run trains and its loss falls."""
    run(job(tmp_path, tok_cache, "trainer.max_steps=6", "trainer.precision=bf16",
            "trainer.compile=true", "trainer.activation_checkpointing=true",
            "trainer.sample_tokens=0"))
    curve = losses(tmp_path)
    assert len(curve) == 6 and all(math.isfinite(v) for v in curve.values())
    assert curve[6] < curve[1]


@pytest.mark.slow
def test_torch_compile_matches_eager(tmp_path, tok_cache):
    run(job(tmp_path / "eager", tok_cache, "trainer.max_steps=2"))
    run(job(tmp_path / "compiled", tok_cache, "trainer.max_steps=2", "trainer.compile=true"))
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert eager.keys() == compiled.keys()
    assert all(abs(eager[k] - compiled[k]) < 1e-4 for k in eager)


def test_resume_auto_refuses_when_every_checkpoint_is_corrupted(tmp_path, tok_cache):
    run(job(tmp_path, tok_cache, "trainer.max_steps=2"))
    ckpt = CheckpointManager(tmp_path / "checkpoints", None).list()[-1]
    (ckpt / "model.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="none passes its checksums"):
        run(job(tmp_path, tok_cache, "trainer.max_steps=4", "resume=auto"))
    assert (ckpt / "model.pt").read_bytes() == b"not a checkpoint"  # left for the user to inspect


@pytest.fixture
def no_cublas_config(monkeypatch):
    """CUBLAS_WORKSPACE_CONFIG unset for the test and as it was afterwards; determinism off after."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_sets_the_cublas_workspace_before_cuda_starts(tmp_path, tok_cache,
                                                                    monkeypatch, no_cublas_config):
    """Without CUBLAS_WORKSPACE_CONFIG, deterministic mode raises at the first cuBLAS GEMM: the
    trainer sets it before ``init_distributed`` (where CUDA starts) and determinism is on."""
    import os

    from scape_train import train as train_module

    seen = []
    real_init = train_module.D.init_distributed

    def init_distributed(*args, **kwargs):
        seen.append(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return real_init(*args, **kwargs)

    monkeypatch.setattr(train_module.D, "init_distributed", init_distributed)
    trainer = train_module.Trainer(job(tmp_path, tok_cache, "trainer.deterministic=true"))
    trainer.train_loader.close()
    assert seen == [":4096:8"] and torch.are_deterministic_algorithms_enabled()


def test_deterministic_refuses_when_cuda_started_without_the_cublas_workspace(monkeypatch,
                                                                              no_cublas_config):
    from scape_train.config import ConfigError
    from scape_train.train import use_deterministic_algorithms

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG=:4096:8 before launching"):
        use_deterministic_algorithms()
    assert not torch.are_deterministic_algorithms_enabled()
