"""Shared by the wall-clock benchmarks: run the real trainer on a shaped cluster and read its log.

``run_cluster`` starts ``python -m scape_train`` once per rank through ``scripts/netcluster``
(one network namespace per rank, links shaped with tc tbf); ``run_independent`` starts the same
trainer as N independent single-process jobs at once (the compute-only bound: the same N
processes competing for the same cores, with no communication). Both return the rows of rank 0's
``metrics.jsonl`` and the 1-minute load average before and after, which the reports print beside
every figure because this machine's 2 cores are shared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python")


def loadavg() -> float:
    """The 1-minute load average (``uptime``'s first figure)."""
    return os.getloadavg()[0]


@dataclass
class RunResult:
    name: str
    rows: list[dict] = field(default_factory=list)   # rank 0's metrics.jsonl (training rows)
    vals: list[dict] = field(default_factory=list)   # rows holding val_loss
    load_before: float = 0.0
    load_after: float = 0.0
    wall_s: float = 0.0
    rc: int = 0
    command: str = ""


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    rows, vals = [], []
    if not path.exists():
        return rows, vals
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        (vals if "val_loss" in rec else rows).append(rec)
    return rows, vals


def _trainer_argv(overrides: list[str], run_dir: Path, entry: list[str] | None = None
                  ) -> list[str]:
    return [*(entry or [PYTHON, "-m", "scape_train"]), *overrides, f"run_dir={run_dir}"]


def run_cluster(name: str, overrides: list[str], out: Path, *, ranks: int, rate: str,
                timeout_s: float = 1800.0, entry: list[str] | None = None) -> RunResult:
    """The trainer on ``ranks`` namespaces behind ``rate`` links ('none' = unshaped veth).
    ``entry``: the command before the overrides (default ``python -m scape_train``)."""
    run_dir = out / name
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    argv = [sys.executable, str(REPO / "scripts" / "netcluster"), "--ranks", str(ranks),
            "--rate", rate, "--omp-threads", "1", "--out", str(run_dir / "logs"),
            "--timeout", str(timeout_s), "--", *_trainer_argv(overrides, run_dir / "run", entry)]
    res = RunResult(name, command=" ".join(argv[1:]).replace(str(REPO) + "/", ""))
    res.load_before = loadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    res.wall_s, res.rc, res.load_after = time.perf_counter() - t0, proc.returncode, loadavg()
    if proc.returncode != 0:
        print(f"[{name}] netcluster exit {proc.returncode}; see {run_dir}/logs\n"
              f"{proc.stderr[-2000:]}", file=sys.stderr)
    res.rows, res.vals = read_metrics(run_dir / "run" / "metrics.jsonl")
    return res


def run_independent(name: str, overrides: list[str], out: Path, *, copies: int,
                    timeout_s: float = 1800.0) -> list[RunResult]:
    """``copies`` single-process trainers started together (no process group, no collectives)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    procs, results = [], []
    before = loadavg()
    t0 = time.perf_counter()
    for i in range(copies):
        run_dir = out / f"{name}_copy{i}"
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        run_dir.mkdir(parents=True)
        argv = _trainer_argv(overrides, run_dir / "run")
        log = open(run_dir / "log.txt", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(argv, cwd=REPO, env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log, run_dir, argv))
    for proc, log, run_dir, argv in procs:
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
        res = RunResult(f"{name}_copy{len(results)}", load_before=before, rc=rc,
                        command=" ".join(argv[1:]).replace(str(REPO) + "/", ""))
        res.rows, res.vals = read_metrics(run_dir / "run" / "metrics.jsonl")
        results.append(res)
    wall, after = time.perf_counter() - t0, loadavg()
    for r in results:
        r.wall_s, r.load_after = wall, after
    return results


def spread(values: list[float]) -> dict[str, float]:
    """Median and min-max (the figures every table prints)."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}
