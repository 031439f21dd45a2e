"""Process death and preemption of the real CLI job: nothing is lost, resume is exact.

A job (``python -m scape_train ... resume=auto``) is killed with SIGKILL at random points and in
the middle of a checkpoint write (when its ``step_X.tmp`` directory appears), then rerun with
``resume=auto`` until it finishes; its final parameters must equal an uninterrupted run's bit for
bit. SIGTERM (preemption) must checkpoint, exit 0, and resume exactly.
"""

from __future__ import annotations

import json
import random
import signal

import pytest

from scape_train.train import run
from tests import _fault_job as fj
from tests.helpers import compose_config

MAX_STEPS = 14
DENSE = [f"trainer.max_steps={MAX_STEPS}", "trainer.keep_last=2"]
# Sparse masks from step 5 on, so SCAPE's residuals and masks are real state to restore.
SCAPE = [f"trainer.max_steps={MAX_STEPS}", "trainer.keep_last=2", "optimizer=scape",
         "optimizer.density=0.1", "optimizer.density_warmup_steps=4", "optimizer.use_triton=off"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return fj.tok_cache(tmp_path_factory)


def reference(tmp_path, cache, extra) -> dict:
    """The same job, uninterrupted, in this process."""
    run(compose_config(fj.overrides(tmp_path / "reference", cache, *extra,
                                    "trainer.checkpoint_every=0")))
    return fj.final_params(tmp_path / "reference")


def kill_and_resume(tmp_path, cache, extra, plans, seed) -> list[fj.Outcome]:
    """Run the CLI job once per kill plan (SIGKILL when its trigger fires), then to the end."""
    run_dir = tmp_path / "killed"
    cmd = fj.cli(run_dir, cache, *extra, "resume=auto")
    rng = random.Random(seed)
    outcomes = []
    for i, plan in enumerate(plans):
        trigger = plan(run_dir, rng)
        proc = fj.launch(cmd, tmp_path / "logs" / f"attempt{i}")
        outcome = fj.kill_when(proc, trigger, run_dir)
        assert outcome.returncode in (0, -signal.SIGKILL), fj.logs(proc)[-3000:]
        outcomes.append(outcome)
    last = fj.launch(cmd, tmp_path / "logs" / "final")
    end = fj.kill_when(last, lambda: False, run_dir)
    assert end.returncode == 0, fj.logs(last)[-3000:]
    assert not end.tmp_left
    return outcomes


def mid_write(min_step):
    return lambda run_dir, rng: fj.tmp_dir_appears(run_dir, min_step)


def anywhere(run_dir, rng):
    return fj.random_point(run_dir, rng)


def _check_kills(outcomes, seed):
    killed = [o for o in outcomes if o.returncode == -signal.SIGKILL]
    assert len(killed) >= 2, f"seed {seed}: the job ended before the kills: {outcomes}"
    # The trigger fires while step_X.tmp exists; SIGKILL lands before the rename at least once.
    assert any(o.tmp_left for o in killed), f"seed {seed}: no kill landed mid-write: {outcomes}"


@pytest.mark.slow
def test_sigkill_dense_resumes_bit_for_bit(tmp_path, cache):
    seed = random.randrange(1 << 30)
    extra = [*DENSE, "trainer.checkpoint_every=2"]
    plans = [mid_write(4), anywhere, mid_write(10)]
    outcomes = kill_and_resume(tmp_path, cache, extra, plans, seed)
    _check_kills(outcomes, seed)
    fj.assert_same_params(reference(tmp_path, cache, DENSE), fj.final_params(tmp_path / "killed"))


@pytest.mark.slow
def test_sigkill_scape_resumes_bit_for_bit(tmp_path, cache):
    seed = random.randrange(1 << 30)
    extra = [*SCAPE, "trainer.checkpoint_every=1"]
    plans = [mid_write(5), anywhere]
    outcomes = kill_and_resume(tmp_path, cache, extra, plans, seed)
    _check_kills(outcomes, seed)
    fj.assert_same_params(reference(tmp_path, cache, SCAPE), fj.final_params(tmp_path / "killed"))


def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(tmp_path, cache):
    run_dir = tmp_path / "preempted"
    cmd = fj.cli(run_dir, cache, *DENSE, "trainer.checkpoint_every=0", "resume=auto")
    proc = fj.launch(cmd, tmp_path / "logs" / "preempted")
    outcome = fj.kill_when(proc, fj.metrics_lines(run_dir, 3), run_dir, sig=signal.SIGTERM)
    text = fj.logs(proc)
    assert outcome.fired and outcome.returncode == 0, text[-3000:]
    assert "signal 15 received" in text and "stopped after step" in text
    saved = fj.final_params(run_dir)  # the preemption checkpoint (checkpoint_every=0: no other)
    stopped = json.loads((sorted((run_dir / "checkpoints").glob("step_*"))[-1]
                          / "manifest.json").read_text())["step"]
    assert 3 <= stopped < MAX_STEPS and saved
    summary = run(compose_config(fj.overrides(run_dir, cache, *DENSE, "trainer.checkpoint_every=0",
                                              "resume=auto")))
    assert summary["step"] == MAX_STEPS
    fj.assert_same_params(reference(tmp_path, cache, DENSE), fj.final_params(run_dir))
