"""What the elastic path costs when nothing fails: a round's wall time of elastic DiLoCo (torchft:
a lighthouse, one replica group per worker, a quorum and a vote per round) against plain DiLoCo
(one gloo group), side by side, alternated.

    python scripts/bench_elastic.py [--rounds 4] [--repeats 4] [--workers 3] [--inner-steps 30]

Each run is ``--workers`` processes of ``python -m scape_train`` (llama_tiny, one thread each) on
this machine. A round's time is ``H`` times the mean logged ``step_time_s`` of every step after
the first round (start-up and the first quorum excluded), averaged over the workers. Prints both,
their ratio per repeat, and the machine's load; writes ``docs/figures/bench_elastic.json`` and
the ``bench_elastic`` section of ``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
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


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "scape_train", "scripts"],
                           cwd=REPO, capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def table(r: dict) -> str:
    """The section of docs/reliability.md, from bench_elastic.json."""
    a = r["args"]
    lines = [f"llama_tiny, DiLoCo H = {a['inner_steps']}, {a['workers']} workers of one process "
             f"and one thread each on this 2-core machine, {a['rounds']} rounds (the first "
             f"excluded), contenders alternated; {r['date']}, commit `{r['commit']}`, load "
             f"{r['load_before']:.1f} before the first run.", "",
             "| repeat | plain DiLoCo (s/round) | elastic DiLoCo (s/round) | elastic / plain | "
             "load (1 min) |", "|---|---|---|---|---|"]
    for i, rep in enumerate(r["repeats"]):
        lines.append(f"| {i} | {rep['plain']:.3f} | {rep['elastic']:.3f} | "
                     f"{rep['elastic'] / rep['plain']:.3f} | {rep['load']:.1f} |")
    ratios = [rep["elastic"] / rep["plain"] for rep in r["repeats"]]
    lines += ["", f"Median elastic / plain {statistics.median(ratios):.3f} (range "
              f"{min(ratios):.3f}-{max(ratios):.3f}) over {len(ratios)} repeats."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--docs", default=str(REPO / "docs"), help="where the JSON and page go")
    args = ap.parse_args()
    load_before = os.getloadavg()
    print(f"load before: {load_before}", flush=True)
    tmp = tempfile.mkdtemp(prefix="bench_elastic_")
    print(f"run directories and logs: {tmp}", flush=True)
    out = {"args": vars(args) | {"docs": None}, "commit": commit(),
           "date": time.strftime("%Y-%m-%d"), "load_before": load_before[0], "repeats": []}
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
        out["repeats"].append({**t, "load": os.getloadavg()[0]})
    print(f"load after: {os.getloadavg()}")
    figures = Path(args.docs) / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    (figures / "bench_elastic.json").write_text(json.dumps(out, indent=1))
    print(table(out))
    import doc_sections
    doc_sections.update("bench_elastic", figures=figures)


if __name__ == "__main__":
    main()
