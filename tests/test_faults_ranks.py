"""A rank of a multi-process job dies or hangs: the others stop with a clear error, in time.

The ranks are real ``python -m scape_train`` processes joined by gloo: either started directly
with RANK/WORLD_SIZE/MASTER_* (no agent, so nothing but our timeout stops the survivors), or by
``torchrun --max-restarts=1``, whose agent restarts the group; the restarted ranks must resume
from the last checkpoint and end bit for bit where an uninterrupted run ends -- dense AdamW, and
SCAPE, whose per-rank residuals die with the rank and come back from the checkpoint. When the
restarts run out the job ends with the agent's error and the last checkpoint intact.
(Elastic DiLoCo / GASLoC, where a lost worker does not stop the others: test_elastic.py.)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from scape_train.checkpoint import CheckpointManager
from scape_train.train import run
from tests import _fault_job as fj
from tests._dist import free_port, run_distributed
from tests.helpers import assert_same_record, compose_config

TIMEOUT_S = 10


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return fj.tok_cache(tmp_path_factory)


def start_ranks(run_dir, cache, world: int, log_dir: Path, *extra: str) -> list:
    port = free_port()
    cmd = fj.cli(run_dir, cache, "trainer.max_steps=100000", "trainer.checkpoint_every=0",
                 "trainer.log_every=10", f"trainer.dist_timeout_s={TIMEOUT_S}", *extra)
    return [fj.launch(cmd, log_dir / f"rank{r}",
                      fj.child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                   WORLD_SIZE=str(world), LOCAL_RANK=str(r)))
            for r in range(world)]


def wait_all(procs, limit_s: float) -> list[float]:
    """Seconds until each process ended; fails (and cleans up) if one outlives ``limit_s``."""
    t0, ended = time.monotonic(), {}
    while len(ended) < len(procs) and time.monotonic() - t0 < limit_s:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert len(ended) == len(procs), f"ranks still running after {limit_s}s (a hang)"
    return [ended[i] for i in range(len(procs))]


def check_clear_error(proc) -> None:
    text = fj.logs(proc)
    assert proc.returncode == 1, text[-3000:]
    assert "lost contact with the other ranks" in text and "resume=auto" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


# SCAPE with sparse masks from step 3 on: residuals and masks are per-rank state a death loses.
SCAPE = ["optimizer=scape", "optimizer.density=0.1", "optimizer.density_warmup_steps=2",
         "optimizer.use_triton=off"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [[], SCAPE], ids=["adamw", "scape"])
def test_one_of_four_ranks_killed_survivors_exit_clearly(tmp_path, cache, optimizer):
    procs = start_ranks(tmp_path / "run", cache, 4, tmp_path / "logs", *optimizer)
    try:
        fj.kill_when(procs[2], fj.metrics_lines(tmp_path / "run", 2), timeout=120)
        survivors = [procs[r] for r in (0, 1, 3)]
        # Gloo sees the closed connection at once; the bound is the configured timeout + exit.
        waited = wait_all(survivors, TIMEOUT_S + 20)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[2].returncode == -signal.SIGKILL
    for p in survivors:
        check_clear_error(p)
    assert max(waited) < TIMEOUT_S + 20


def test_hung_rank_others_time_out_instead_of_waiting_forever(tmp_path, cache):
    training = fj.metrics_lines(tmp_path / "run", 1)
    procs = start_ranks(tmp_path / "run", cache, 2, tmp_path / "logs")
    try:
        t0 = time.monotonic()
        while not training():
            assert procs[0].poll() is None, fj.logs(procs[0])[-3000:]
            assert time.monotonic() - t0 < 120, "the job did not start training"
            time.sleep(0.01)
        os.kill(procs[1].pid, signal.SIGSTOP)  # alive, holding its sockets, never answering
        waited = wait_all(procs[:1], TIMEOUT_S + 20)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    check_clear_error(procs[0])
    assert TIMEOUT_S - 1 <= waited[0] < TIMEOUT_S + 20


# ---------------------------------------------------------------- torchrun restarts the group

def _worker_of_rank(agent_pid: int, rank: int) -> int | None:
    for pid in fj.children(agent_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def _reference_2ranks(rank, world, run_dir, cache, extra):
    run(compose_config(fj.overrides(run_dir, cache, *extra)))


# A crash is seen at once (the connection closes): the longer timeout only keeps a loaded
# machine's slow start (the first rank training the tokenizer) from being taken for a hang.
TORCHRUN_JOB = ["trainer.max_steps=30", "trainer.checkpoint_every=2", "trainer.keep_last=2",
                f"trainer.dist_timeout_s={3 * TIMEOUT_S}"]


def _torchrun_killing_rank1(tmp_path, cache, job: list[str], kill_at_steps: list[int]):
    """torchrun --max-restarts=1 over two ranks; rank 1 is SIGKILLed once the checkpoint of
    each step in ``kill_at_steps`` exists (one kill per attempt). Returns (agent, kills)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", "--monitor-interval=0.5", "-m", "scape_train",
           *fj.overrides(run_dir, cache, *job, "resume=auto")]
    agent = fj.launch(cmd, tmp_path / "logs" / "torchrun")
    pending, killed = list(kill_at_steps), []
    t0 = time.monotonic()
    while agent.poll() is None and time.monotonic() - t0 < 240:
        if pending and (run_dir / "checkpoints" / f"step_{pending[0]:08d}").exists():
            pid = _worker_of_rank(agent.pid, 1)
            if pid and pid not in killed:
                os.kill(pid, signal.SIGKILL)  # a real crash of rank 1 mid-training
                killed.append(pid)
                pending.pop(0)
        time.sleep(0.002)
    if agent.poll() is None:
        agent.kill()
    agent.wait()
    return agent, killed


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [[], SCAPE], ids=["adamw", "scape"])
def test_torchrun_max_restarts_resumes_from_last_checkpoint(tmp_path, cache, optimizer):
    job = [*TORCHRUN_JOB, *optimizer]
    agent, killed = _torchrun_killing_rank1(tmp_path, cache, job, [4])
    text = fj.logs(agent)
    assert killed, text[-3000:]
    assert agent.returncode == 0, text[-4000:]
    assert "(exitcode: -9) local_rank: 1" in text, text[-4000:]  # the agent saw the crash
    assert text.count("INFO scape_train: resumed from") == 2, text[-4000:]  # both ranks, restarted
    ref = tmp_path / "reference"
    run_distributed(_reference_2ranks, 2, (str(ref), cache, job))
    # SCAPE: bit for bit only if every rank's residuals and the masks came back from the checkpoint
    fj.assert_same_params(fj.final_params(ref), fj.final_params(tmp_path / "run"))
    assert_same_record(ref, tmp_path / "run")   # tokens and bytes sent continue across the restart


@pytest.mark.slow
def test_torchrun_restarts_running_out_end_clearly_with_the_last_checkpoint_intact(tmp_path, cache):
    job = [*TORCHRUN_JOB, *SCAPE]
    agent, killed = _torchrun_killing_rank1(tmp_path, cache, job, [4, 8])
    text = fj.logs(agent)
    assert len(killed) == 2, text[-3000:]
    assert agent.returncode != 0, text[-4000:]                   # the job ends, not hangs
    assert "ChildFailedError" in text and "exitcode  : -9" in text, text[-4000:]
    ckpts = CheckpointManager(tmp_path / "run" / "checkpoints", None)
    last = ckpts.latest_valid()
    assert last is not None and int(last.name[5:]) >= 8, (last, text[-3000:])
    # the last checkpoint is whole: a fresh two-rank run resumes from it and ends where an
    # uninterrupted run ends, bit for bit (SCAPE's residuals and masks included)
    run_distributed(_reference_2ranks, 2, (str(tmp_path / "run"), cache, [*job, "resume=auto"]))
    ref = tmp_path / "reference"
    run_distributed(_reference_2ranks, 2, (str(ref), cache, job))
    fj.assert_same_params(fj.final_params(ref), fj.final_params(tmp_path / "run"))
    assert_same_record(ref, tmp_path / "run")
