"""Process death and preemption of the real CLI job: nothing is lost, resume is exact.

A job (``python -m scape_train ... resume=auto``) is killed with SIGKILL at random points and in
the middle of a checkpoint write (when its ``step_X.tmp`` directory appears), then rerun with
``resume=auto`` until it finishes; its final parameters must equal an uninterrupted run's bit for
bit. SIGTERM (preemption) must checkpoint, exit 0, and resume exactly.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time

import pytest

from scape_train.checkpoint import CheckpointManager
from scape_train.train import run
from tests import _fault_job as fj
from tests.helpers import assert_same_record, compose_config

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
    assert_same_record(tmp_path / "reference", tmp_path / "killed")   # metrics kept once each


@pytest.mark.slow
def test_sigkill_scape_resumes_bit_for_bit(tmp_path, cache):
    seed = random.randrange(1 << 30)
    extra = [*SCAPE, "trainer.checkpoint_every=1"]
    plans = [mid_write(5), anywhere]
    outcomes = kill_and_resume(tmp_path, cache, extra, plans, seed)
    _check_kills(outcomes, seed)
    fj.assert_same_params(reference(tmp_path, cache, SCAPE), fj.final_params(tmp_path / "killed"))
    assert_same_record(tmp_path / "reference", tmp_path / "killed")   # metrics kept once each


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
    assert_same_record(tmp_path / "reference", run_dir)


# ---------------------------------------------------------------- preemption under torchrun/Slurm

SLOW_SAVE_S = 35     # longer than torchrun's default shutdown timeout (30 s)


def _preempt(agent, to: str) -> None:
    """SIGTERM to torchrun's agent; or, as Slurm does, to every process of the step. Signals
    that reach a process together merge into one, so the workers get theirs first and the
    agent (which forwards it to them again) once both have taken it."""
    if to == "every process":
        for pid in fj.children(agent.pid):
            os.kill(pid, signal.SIGTERM)
        t0 = time.monotonic()
        while fj.logs(agent).count("signal 15 received") < 2 and time.monotonic() - t0 < 30:
            time.sleep(0.01)
    os.kill(agent.pid, signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["agent", "every process"])
def test_preemption_under_torchrun_keeps_a_slow_checkpoint_and_resumes(tmp_path, cache, to):
    """scripts/launch_torchrun.sh, 2 gloo ranks, every save 35 s long: SIGTERM mid-training
    (to the agent, which forwards it; or to every process, which gives the workers the signal
    twice) must end with a new checkpoint on disk, not with the agent's SIGKILL, and a clean
    resume from it."""
    run_dir = tmp_path / "run"
    cmd = ["bash", str(fj.REPO / "scripts" / "launch_torchrun.sh"),
           *fj.overrides(run_dir, cache, *DENSE, "trainer.checkpoint_every=0", "resume=auto")]
    env = fj.child_env(NPROC="2", PY=sys.executable)
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    agent = fj.launch(cmd, tmp_path / "logs" / "preempted",
                      dict(env, SCAPE_FAULT_SAVE_DELAY_S=str(SLOW_SAVE_S)))
    training, t0 = fj.metrics_lines(run_dir, 3), time.monotonic()
    while not training() and agent.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.005)
    assert agent.poll() is None, fj.logs(agent)[-3000:]
    _preempt(agent, to)
    outcome = fj.kill_when(agent, lambda: False, run_dir, timeout=240)
    text = fj.logs(agent)
    saved = CheckpointManager(run_dir / "checkpoints", None).latest_valid()
    assert saved is not None and not outcome.tmp_left, text[-4000:]
    assert text.count("stopped after step") == 2 and "exitcode: -9" not in text, text[-4000:]
    stopped = json.loads((saved / "manifest.json").read_text())["step"]
    assert 3 <= stopped < MAX_STEPS
    resumed = fj.launch(cmd, tmp_path / "logs" / "resumed", env)
    end = fj.kill_when(resumed, lambda: False, run_dir, timeout=240)
    text = fj.logs(resumed)
    assert end.returncode == 0, text[-4000:]
    assert text.count(f"resumed from {saved}") == 2, text[-4000:]
    assert json.loads((CheckpointManager(run_dir / "checkpoints", None).latest_valid()
                       / "manifest.json").read_text())["step"] == MAX_STEPS


def test_the_preemption_budget_is_ordered():
    """Slurm's signal lead > torchrun's shutdown timeout > the 30 s default a Llama-1.8B save
    outlasts, both launchers source that budget and pass the timeout to torchrun."""
    scripts = fj.REPO / "scripts"
    budget = (scripts / "preemption.sh").read_text()
    lead = int(re.search(r"^SCAPE_SIGNAL_LEAD_S=(\d+)$", budget, re.M).group(1))
    timeout = int(re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-(\d+)", budget).group(1))
    sbatch = (scripts / "launch_slurm.sbatch").read_text()
    assert int(re.search(r"^#SBATCH --signal=TERM@(\d+)", sbatch, re.M).group(1)) == lead
    assert 30 < timeout < lead - 30
    for launcher in ("launch_slurm.sbatch", "launch_torchrun.sh"):
        text = (scripts / launcher).read_text()
        assert "source scripts/preemption.sh" in text, launcher
        assert '--shutdown_timeout="$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"' in text, launcher


def test_a_repeated_signal_within_seconds_is_the_same_request(monkeypatch):
    """Slurm signals the worker and torchrun's agent forwards the signal again: the repeat must
    not abort the checkpoint; a later one (someone insisting) stops at once."""
    from scape_train import train as train_module

    clock = [100.0]
    monkeypatch.setattr(train_module.time, "monotonic", lambda: clock[0])
    with train_module.StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        clock[0] += 0.5
        os.kill(os.getpid(), signal.SIGTERM)          # the agent's forwarded copy
        assert stop.requested
        clock[0] += 60.0
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def _signal_after_agreement_job(rank, world, run_dir, cache):
    """Rank 0 alone gets SIGTERM inside step 3's optimizer update, after the ranks agreed on step
    3's stop flag: both must stop together, at step 4, with one checkpoint."""
    from scape_train.optim.dense import DenseStrategy

    step, updates = DenseStrategy.step, []

    def step_then_signal(self, lr):
        updates.append(lr)
        if rank == 0 and len(updates) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, lr)

    DenseStrategy.step = step_then_signal
    summary = run(compose_config(fj.overrides(run_dir, cache, *DENSE, "trainer.checkpoint_every=0",
                                              "trainer.dist_timeout_s=20")))
    return summary["step"], summary.get("stopped_early"), summary.get("checkpoint")


def test_a_signal_after_the_steps_agreement_stops_every_rank_at_the_next_step(tmp_path, cache):
    """The loop acts on the agreed stop flag, not on this process's live one: a signal landing
    between the agreement and the loop's check sent one rank to checkpoint while the other
    trained on (a collective mismatch under gloo: "Received data size doesn't match")."""
    from tests._dist import run_distributed

    results = run_distributed(_signal_after_agreement_job, 2, (str(tmp_path), cache))
    assert results[0] == results[1] == (4, True, str(tmp_path / "checkpoints" / "step_00000004"))
