"""Non-finite losses: ``trainer.nan_policy=skip`` (bounded) and ``stop``, on the real trainer.

Two real mechanisms make the loss non-finite:
- ``SCAPE_FAULT_NAN_STEPS=3,4`` (the trainer's only fault hook, off unless set) multiplies this
  process's loss by NaN at those steps, as a corrupt batch would: NaN gradients flow through the
  real backward and must never reach the weights;
- ``optimizer.lr=1e30`` really overflows the weights, after which every loss is non-finite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scape_train.checkpoint import CheckpointManager
from scape_train.train import NonFiniteLossError, run
from tests import _fault_job as fj
from tests._dist import run_distributed
from tests.helpers import compose_config


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return fj.tok_cache(tmp_path_factory)


def job(run_dir, cache, *extra):
    return compose_config(fj.overrides(run_dir, cache, "trainer.max_steps=7",
                                       "trainer.checkpoint_every=1", "trainer.keep_last=10", *extra))


def ckpt(run_dir, step: int) -> tuple[dict, dict]:
    """(model, rank 0's state): its own file and the replicated one (written once, by rank 0)."""
    path = Path(run_dir) / "checkpoints" / f"step_{step:08d}"
    own = torch.load(path / "rank_00000.pt", weights_only=True)
    replicated = torch.load(path / "replicated.pt", weights_only=True)
    return (torch.load(path / "model.pt", weights_only=True),
            {"optimizer": {"replicated": replicated["optimizer"], "own": own["optimizer"]},
             "data": own["data"], "train": replicated["train"]})


def rows(run_dir) -> dict[int, dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.parametrize("optimizer", ["adamw", "scape"])
def test_skip_leaves_weights_and_state_untouched_then_continues(tmp_path, cache, monkeypatch,
                                                               optimizer):
    monkeypatch.setenv("SCAPE_FAULT_NAN_STEPS", "3,4")
    summary = run(job(tmp_path, cache, f"optimizer={optimizer}", "trainer.nan_policy=skip",
                      "trainer.max_nan_skips=2", "optimizer.density_warmup_steps=2"))
    assert summary["step"] == 7
    logged = rows(tmp_path)
    assert [s for s, r in logged.items() if r.get("skipped_nonfinite")] == [3, 4]
    (m2, r2), (m4, r4), (m5, _) = ckpt(tmp_path, 2), ckpt(tmp_path, 4), ckpt(tmp_path, 5)
    # Skipped steps change neither the weights nor the optimizer state; they consume their data.
    assert all(torch.equal(m2[k], m4[k]) for k in m2)
    flat2, flat4 = _tensors(r2["optimizer"]), _tensors(r4["optimizer"])
    assert flat2.keys() == flat4.keys() and all(torch.equal(flat2[k], flat4[k]) for k in flat2)
    assert r4["data"]["counters"]["batches"] == r2["data"]["counters"]["batches"] + 2
    assert r4["train"]["nan_skips"] == 2 and r4["train"]["tokens"] == r2["train"]["tokens"]
    assert any(not torch.equal(m4[k], m5[k]) for k in m4)  # step 5 trains again
    assert all(torch.isfinite(v).all() for v in fj.final_params(tmp_path).values())


def _tensors(tree, prefix="") -> dict[str, torch.Tensor]:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_tensors(v, f"{prefix}/{i}"))
    elif isinstance(tree, torch.Tensor):
        out[prefix] = tree
    return out


def test_skip_is_bounded(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("SCAPE_FAULT_NAN_STEPS", "3,4,5")
    with pytest.raises(NonFiniteLossError, match=r"at step 5 \(3 in a row\)") as err:
        run(job(tmp_path, cache, "trainer.nan_policy=skip", "trainer.max_nan_skips=2"))
    assert "step_00000004" in str(err.value)  # the last good checkpoint is named


def test_skip_is_bounded_when_weights_really_overflow(tmp_path, cache):
    # lr=1e30 without clipping: the weights overflow for real and every later loss is non-finite.
    with pytest.raises(NonFiniteLossError, match=r"in a row|non-finite parameters"):
        run(job(tmp_path, cache, "trainer.max_steps=30", "trainer.nan_policy=skip",
                "trainer.max_nan_skips=3", "optimizer.lr=1e30", "optimizer.min_lr=0",
                "optimizer.clip_grad=0", "trainer.warmup_steps=0"))
    last = CheckpointManager(tmp_path / "checkpoints", None).latest_valid()
    state = torch.load(last / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values())


def test_stop_names_step_and_resume_continues(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("SCAPE_FAULT_NAN_STEPS", "3")
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(nan\) at step 3\. .*step_00000002"):
        run(job(tmp_path, cache, "trainer.nan_policy=stop"))
    assert [p.name for p in CheckpointManager(tmp_path / "checkpoints", None).list()] == [
        "step_00000001", "step_00000002"]
    monkeypatch.delenv("SCAPE_FAULT_NAN_STEPS")
    assert run(job(tmp_path, cache, "resume=auto"))["step"] == 7


def _two_ranks_one_bad_between_checkpoints(rank, world, run_dir, cache):
    import os

    if rank == 1:
        os.environ["SCAPE_FAULT_NAN_STEPS"] = "3"
    try:
        run(job(run_dir, cache, "trainer.checkpoint_every=2", "trainer.log_every=4",
                "trainer.dist_timeout_s=60", "trainer.nan_policy=stop"))
    except NonFiniteLossError as exc:
        return str(exc)
    return "no error"


def test_stop_between_checkpoints_reads_the_flags_a_step_late_and_saves_nothing_bad(tmp_path,
                                                                                     cache):
    """Step 3 is neither a log nor a checkpoint step, so its flags are read at step 4: the NaN
    update of step 3 is never saved, both ranks stop at the same point naming step 3, and the
    checkpoint of step 2 is the last, finite."""
    errors = run_distributed(_two_ranks_one_bad_between_checkpoints, 2, (str(tmp_path), cache))
    assert all("non-finite loss (nan) at step 3." in e and "step_00000002" in e for e in errors), \
        errors
    manager = CheckpointManager(tmp_path / "checkpoints", None)
    assert [p.name for p in manager.list()] == ["step_00000002"]
    state = torch.load(manager.latest_valid() / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values())


def _two_ranks_one_bad(rank, world, run_dir, cache):
    import os

    if rank == 1:  # only rank 1 sees the bad batch; both must skip the step together
        os.environ["SCAPE_FAULT_NAN_STEPS"] = "2"
    summary = run(job(run_dir, cache, "trainer.max_steps=4", "trainer.nan_policy=skip",
                      "trainer.dist_timeout_s=60"))
    return summary["step"], rows(run_dir)[2].get("skipped_nonfinite") if rank == 0 else None


def test_one_rank_nonfinite_all_ranks_skip_together(tmp_path, cache):
    results = run_distributed(_two_ranks_one_bad, 2, (str(tmp_path), cache))
    assert results[0] == (4, 1.0) and results[1][0] == 4
    m1, _ = ckpt(tmp_path, 1)
    m2, _ = ckpt(tmp_path, 2)
    assert all(torch.equal(m1[k], m2[k]) for k in m1)
