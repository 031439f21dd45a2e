"""An elastic DiLoCo / GASLoC / SparseLoCo job as real processes: a lighthouse and one
``python -m scape_train`` per worker (each its own torchft replica group), hurt at real points.

    job = ElasticJob(tmp_path, cache, "trainer.max_steps=100")
    job.launch(3)                       # the lighthouse and workers 0, 1, 2
    job.wait_rows(2, 3)                 # worker 2 committed or failed 3 rounds
    job.signal(2, SIGKILL)
    job.wait_done([0, 1])
    job.rows(0)                         # its elastic.jsonl

Every process is killed by ``close()`` (the tests call it from a fixture), so no failure leaves a
worker or a lighthouse running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests import _fault_job as fj
from tests._dist import free_port
from tests.helpers import metrics_rows

H = 5           # inner steps per round
SLOTS = 4       # data shards: up to four workers at once
TIMEOUT_S = 8   # collectives and votes: a frozen worker is cut after this


class ElasticJob:
    def __init__(self, root: Path, cache: str, *extra: str, strategy: str = "diloco",
                 min_replicas: int = 1):
        """``min_replicas``: the lighthouse's; a fault-free reference sets it to its worker count,
        so that a worker slow to start (torch imports on a loaded machine) cannot miss the
        first rounds and heal in later, which changes the trajectory."""
        self.root, self.cache, self.extra, self.strategy = Path(root), cache, extra, strategy
        self.min_replicas = min_replicas
        self.port = free_port()
        self.lighthouse: subprocess.Popen | None = None
        self.workers: dict[int, subprocess.Popen] = {}
        self.lives: dict[int, int] = {}
        self.old: list[subprocess.Popen] = []

    # -- processes ---------------------------------------------------------------------------
    def start_lighthouse(self) -> None:
        """The lighthouse (again, on the same port, after it was killed)."""
        if self.lighthouse is not None:
            self.old.append(self.lighthouse)
        cmd = [sys.executable, "-m", "scape_train.elastic", "lighthouse", "--port",
               str(self.port), "--join-timeout-ms", "2000", "--heartbeat-timeout-ms", "2000",
               "--min-replicas", str(self.min_replicas)]
        self.lighthouse = fj.launch(cmd, self.root / "logs" / f"lighthouse{len(self.old)}")

    def launch(self, workers: int, env: dict[int, dict[str, str]] | None = None) -> None:
        """The lighthouse, then workers ``0 .. workers-1`` (``env``: a slot's extra variables)."""
        self.start_lighthouse()
        for s in range(workers):
            self.start(s, env=(env or {}).get(s))

    def run_dir(self, slot: int) -> Path:
        return self.root / f"r{slot}"

    def start(self, slot: int, env: dict[str, str] | None = None) -> subprocess.Popen:
        life = self.lives.get(slot, -1) + 1
        self.lives[slot] = life
        if slot in self.workers:
            self.old.append(self.workers[slot])
        cmd = fj.cli(self.run_dir(slot), self.cache, f"strategy={self.strategy}",
                     f"strategy.inner_steps={H}", "strategy.elastic.enabled=true",
                     f"strategy.elastic.lighthouse=http://localhost:{self.port}",
                     f"strategy.elastic.slots={SLOTS}", f"strategy.elastic.replica={slot}",
                     f"strategy.elastic.timeout_s={TIMEOUT_S}", "strategy.elastic.quorum_retries=60",
                     "trainer.sample_tokens=0", "resume=auto", "trainer.checkpoint_every=0",
                     *self.extra)
        proc = fj.launch(cmd, self.root / "logs" / f"w{slot}_{life}", fj.child_env(**(env or {})))
        self.workers[slot] = proc
        return proc

    def signal(self, slot: int, sig: int) -> None:
        os.kill(self.workers[slot].pid, sig)

    def close(self) -> None:
        for p in [*self.workers.values(), *self.old, self.lighthouse]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    # -- waiting -----------------------------------------------------------------------------
    def rows(self, slot: int) -> list[dict]:
        path = self.run_dir(slot) / "elastic.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def rounds(self, slot: int) -> list[dict]:
        return [r for r in self.rows(slot) if "committed" in r]

    def wait_until(self, check, what: str, limit_s: float = 120.0) -> None:
        t0 = time.monotonic()
        while not check():
            for slot, p in self.workers.items():
                if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL):
                    raise AssertionError(f"worker {slot} ended with {p.returncode} while "
                                         f"waiting for {what}:\n{fj.logs(p)[-3000:]}")
            if time.monotonic() - t0 > limit_s:
                raise AssertionError(f"{what}: not within {limit_s}s")
            time.sleep(0.01)

    def wait_rows(self, slot: int, n: int, limit_s: float = 120.0) -> None:
        """Worker ``slot`` (this life) has ended ``n`` rounds."""
        pid = self.workers[slot].pid
        self.wait_until(lambda: sum(1 for r in self.rounds(slot) if r["pid"] == pid) >= n,
                        f"worker {slot}: {n} rounds", limit_s)

    def wait_mid_round(self, slot: int, limit_s: float = 120.0) -> None:
        """Until worker ``slot`` is inside a round that every launched worker is in: worker 0
        committed a round with all of them (a worker slow to start on a loaded machine may have
        trained alone until then), and ``slot`` has since logged two more steps (one line per
        step, written after any exchange that step ended), so it is past the next quorum and
        before that round's exchange. A worker stopped there makes its peers' exchange fail."""
        everyone = sorted(self.workers)
        self.wait_until(lambda: any(r["committed"] and r["quorum"] == everyone
                                    for r in self.rounds(0)),
                        f"a round of workers {everyone}", limit_s)
        self.wait_until(fj.metrics_lines(self.run_dir(slot), 1), f"worker {slot} mid-round",
                        limit_s)

    def wait_done(self, slots, limit_s: float = 150.0) -> None:
        self.wait_until(lambda: all(self.workers[s].poll() is not None for s in slots),
                        f"workers {list(slots)} to finish", limit_s)
        for s in slots:
            p = self.workers[s]
            assert p.returncode == 0, f"worker {s} ended with {p.returncode}:\n{fj.logs(p)[-3000:]}"
            # torchft's checkpoint server prints a peer's broken download with a traceback of
            # its own; the trainer must raise nothing
            assert f'File "{fj.REPO / "scape_train"}' not in fj.logs(p), fj.logs(p)[-3000:]

    # -- results -----------------------------------------------------------------------------
    def final_params(self, slot: int) -> dict[str, torch.Tensor]:
        return fj.final_params(self.run_dir(slot))

    def metrics(self, slot: int) -> list[dict]:
        """Worker ``slot``'s ``metrics.jsonl`` rows."""
        return metrics_rows(self.run_dir(slot))

    def val_loss(self, slot: int) -> float:
        return [r["val_loss"] for r in self.metrics(slot) if "val_loss" in r][-1]
