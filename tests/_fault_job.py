"""Run the small training job as real subprocesses and hurt them at real points.

Fault tests need the product's own entry point (``python -m scape_train``), real process deaths
(SIGKILL, SIGTERM, SIGSTOP) and real files; nothing here patches the trainer. The pieces:

    cmd = cli(run_dir, tok_cache, "trainer.max_steps=12")      # argv of the CLI job
    proc = launch(cmd, log_dir / "attempt1")                    # stdout/stderr to files
    outcome = kill_when(proc, tmp_dir_appears(run_dir), timeout=120)
    final_params(run_dir)                                       # model.pt of the newest valid checkpoint

Triggers are polled every half millisecond on the child's own files (a checkpoint's ``.tmp``
directory, the metrics file), so a kill lands where the child really is, e.g. mid-write.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from scape_train.checkpoint import CheckpointManager
from tests.helpers import SMALL

REPO = Path(__file__).resolve().parents[1]


def tok_cache(tmp_path_factory) -> str:
    """One trained-tokenizer cache for the session's small-job test modules (the fault tests,
    train, summary, generate, NCCL rules): each vocabulary size is trained once."""
    path = tmp_path_factory.getbasetemp() / "tokenizers"
    path.mkdir(exist_ok=True)
    return str(path)


def overrides(run_dir, cache: str, *extra: str) -> list[str]:
    """The small job's Hydra overrides (shared with tests/test_train.py) for one run directory."""
    return [*SMALL, f"run_dir={run_dir}", f"data.tokenizer.cache_dir={cache}", *extra]


def cli(run_dir, cache: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "scape_train", *overrides(run_dir, cache, *extra)]


def child_env(**extra: str) -> dict[str, str]:
    """The test environment (offline hubs, W&B off: set by conftest) plus one thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env.pop("SCAPE_TRACEBACK", None)
    return env


def launch(cmd: list[str], log_prefix: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in the repo with stdout/stderr in ``<log_prefix>.out`` / ``.err``."""
    log_prefix = Path(log_prefix)
    log_prefix.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_prefix.with_suffix(".out"), "wb")
    err = open(log_prefix.with_suffix(".err"), "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env or child_env(), stdout=out, stderr=err,
                            start_new_session=True)
    proc.log_prefix = log_prefix  # type: ignore[attr-defined]
    out.close()
    err.close()
    return proc


def logs(proc: subprocess.Popen) -> str:
    prefix: Path = proc.log_prefix  # type: ignore[attr-defined]
    return (prefix.with_suffix(".out").read_text(errors="replace")
            + prefix.with_suffix(".err").read_text(errors="replace"))


# ------------------------------------------------------------------ triggers

Trigger = Callable[[], bool]


def tmp_dir_appears(run_dir, min_step: int = 1) -> Trigger:
    """True while a checkpoint of step >= min_step is being written (its ``.tmp`` directory)."""
    root = Path(run_dir) / "checkpoints"

    def check() -> bool:
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return False
        return any(n.endswith(".tmp") and int(n[5:13]) >= min_step for n in names)
    return check


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def metrics_lines(run_dir, n: int) -> Trigger:
    """True once ``metrics.jsonl`` got more than ``n`` lines beyond those it holds now (an
    earlier attempt's lines do not count): this attempt is training. A resumed run first drops
    the rows logged after its checkpoint (the file shrinks): lines count from there."""
    path = Path(run_dir) / "metrics.jsonl"
    base = [_lines(path)]

    def check() -> bool:
        now = _lines(path)
        base[0] = min(base[0], now)
        return now - base[0] > n
    return check


def after_delay(first: Trigger, delay_s: float) -> Trigger:
    """``first``, then ``delay_s`` more seconds: a random point inside training."""
    since: list[float] = []

    def check() -> bool:
        if not since:
            if first():
                since.append(time.monotonic())
            return False
        return time.monotonic() - since[0] >= delay_s
    return check


def random_point(run_dir, rng: random.Random, max_delay_s: float = 0.05) -> Trigger:
    """After 1-4 logged steps of this attempt, plus up to ``max_delay_s``."""
    return after_delay(metrics_lines(run_dir, rng.randint(0, 3)), rng.uniform(0.0, max_delay_s))


# ------------------------------------------------------------------ killing

@dataclass
class Outcome:
    returncode: int
    fired: bool          # the trigger fired and the signal was sent before the process ended
    seconds: float
    tmp_left: bool       # a ``.tmp`` checkpoint directory was left behind (killed mid-write)


def kill_when(proc: subprocess.Popen, trigger: Trigger, run_dir=None, sig: int = signal.SIGKILL,
              timeout: float = 180.0) -> Outcome:
    """Poll ``trigger`` while ``proc`` runs; send ``sig`` when it fires; wait for the end."""
    t0 = time.monotonic()
    fired = False
    while proc.poll() is None:
        if not fired and trigger():
            os.kill(proc.pid, sig)
            fired = True
        if time.monotonic() - t0 > timeout:
            proc.kill()
            proc.wait()
            raise AssertionError(f"job did not end within {timeout}s:\n{logs(proc)[-3000:]}")
        time.sleep(0.0005)
    tmp_left = bool(run_dir) and any((Path(run_dir) / "checkpoints").glob("*.tmp"))
    return Outcome(proc.returncode, fired, time.monotonic() - t0, tmp_left)


def run_to_end(cmd: list[str], log_prefix: Path, env=None, timeout: float = 180.0) -> Outcome:
    proc = launch(cmd, log_prefix, env)
    return kill_when(proc, lambda: False, timeout=timeout)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers: in sessions of their own)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


# ------------------------------------------------------------------ results

def final_params(run_dir) -> dict[str, torch.Tensor]:
    path = CheckpointManager(Path(run_dir) / "checkpoints", None).latest_valid()
    assert path is not None, f"no valid checkpoint in {run_dir}"
    return torch.load(path / "model.pt", map_location="cpu", weights_only=True)


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"parameters differ bit-wise: {differ[:5]}"
