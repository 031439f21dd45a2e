"""What the elastic path costs when nothing fails: a round's wall time of elastic DiLoCo (torchft:
a lighthouse, one replica group per worker, a quorum and a vote per round) against plain DiLoCo
(one gloo group), side by side, alternated.

    python scripts/bench_elastic.py [--rounds 4] [--repeats 2] [--workers 3] [--inner-steps 30]

Each run is ``--workers`` processes of ``python -m scape_train`` (llama_tiny, one thread each) on
this machine. A round's time is ``H`` times the mean logged ``step_time_s`` of every step after
the first round (start-up and the first quorum excluded), averaged over the workers. Prints both,
their ratio per repeat, and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = ["model=llama_tiny", "data.seq_len=128", "trainer.micro_batch_size=4", "trainer.log_every=1",
       "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.num_threads=1",
       "trainer.sample_tokens=0", "logging.wandb.mode=disabled", "logging.progress_bar=false",
       "strategy=diloco"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", **extra)


def round_seconds(run_dir: Path, h: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > h]
    return h * sum(times) / len(times)


def run(kind: str, root: Path, args) -> float:
    """One job of ``kind`` (plain | elastic); the workers' mean round time in seconds."""
    steps = args.rounds * args.inner_steps
    job = [*JOB, f"strategy.inner_steps={args.inner_steps}", f"trainer.max_steps={steps}",
           f"trainer.warmup_steps={min(40, steps // 4)}"]
    procs, lighthouse, port = [], None, free_port()
    logs = open(root / f"{kind}.log", "ab")
    try:
        if kind == "elastic":
            lighthouse = subprocess.Popen([sys.executable, "-m", "scape_train.elastic", "lighthouse",
                                           "--port", str(port)], cwd=REPO, env=env(),
                                          stdout=logs, stderr=logs)
        for w in range(args.workers):
            run_dir = root / f"{kind}_{w}"
            if kind == "elastic":
                extra = ["strategy.elastic.enabled=true", f"strategy.elastic.slots={args.workers}",
                         f"strategy.elastic.replica={w}",
                         f"strategy.elastic.lighthouse=http://localhost:{port}"]
                e = env()
            else:
                extra = []
                e = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(w),
                        WORLD_SIZE=str(args.workers), LOCAL_RANK=str(w))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "scape_train", *job, *extra, f"run_dir={run_dir}"],
                cwd=REPO, env=e, stdout=logs, stderr=logs))
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise RuntimeError(f"a {kind} worker failed: see {root / f'{kind}.log'}")
    finally:
        for p in [*procs, lighthouse]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        logs.close()
    if kind == "plain":   # one group: rank 0 writes the run's metrics
        return round_seconds(root / "plain_0", args.inner_steps)
    per = [round_seconds(root / f"elastic_{w}", args.inner_steps) for w in range(args.workers)]
    return sum(per) / len(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=30)
    args = ap.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)
    tmp = tempfile.mkdtemp(prefix="bench_elastic_")
    print(f"run directories and logs: {tmp}", flush=True)
    for i in range(args.repeats):
        root = Path(tmp) / f"r{i}"
        root.mkdir()
        t = {}
        for kind in (("plain", "elastic") if i % 2 == 0 else ("elastic", "plain")):
            start = time.time()
            t[kind] = run(kind, root, args)
            print(f"repeat {i} {kind}: {t[kind]:.3f} s per round (H={args.inner_steps}, "
                  f"{args.workers} workers; run {time.time() - start:.0f} s; load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
        print(f"repeat {i}: elastic / plain = {t['elastic'] / t['plain']:.3f}", flush=True)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
