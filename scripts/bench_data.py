"""Loader throughput vs what the trainer consumes, for the default job (data=classics).

    python scripts/bench_data.py [--batches 400] [--no-trainer] [--out outputs/bench_data.md]

    python scripts/bench_data.py --compare 1,3 --data <train.jsonl> --sp <tokenizer dir> \
        [--seq 4096 --micro 16 --batches 12 --rounds 3 --busy-ms 0]

``--compare`` measures loaders with the given ``data.num_workers`` side by side, alternated
over ``--rounds`` rounds (one fresh loader each, timed from its first batch), on a local JSON-lines
file and a SentencePiece tokenizer: tokens/s of ``next(loader)``. ``--busy-ms`` makes the
consuming thread hold the interpreter lock that long per batch in pure Python, as an eager
training loop does, and reports the time it then waits for data per batch. Also reported: the
CPU time the trainer's own process spends per batch (all its threads, the spin excluded): what
the loader takes from the training loop's process, where tokenizer processes take nothing.

1. The loader alone: tokens/s of ``next(loader)`` (micro batch 8, seq 256, background worker on),
   after the first batch (the one-off BPE training/cache load is timed separately).
2. The trainer's need: ``python -m scape_train trainer.max_steps=30 logging.wandb.mode=disabled
   run_dir=<tmp>`` as a subprocess, ``tokens_per_s`` read from ``<tmp>/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# warmup_steps must fit in max_steps=30 (the default 40 fails validation).
TRAINER_CMD = [sys.executable, "-m", "scape_train", "trainer.max_steps=30", "trainer.warmup_steps=5",
               "logging.wandb.mode=disabled"]


def bench_loader(batches: int, micro: int) -> dict:
    from scape_train.data import DataConfig, build_tokenizer, build_train_loader

    cfg = DataConfig()          # the default job's data: classics, trained 8k BPE, seq 256
    t0 = time.perf_counter()
    tok = build_tokenizer(cfg)
    tok_s = time.perf_counter() - t0
    loader = build_train_loader(cfg, tok, micro)
    next(loader)
    t0 = time.perf_counter()
    n = sum(next(loader)[0].numel() for _ in range(batches))
    dt = time.perf_counter() - t0
    m = loader.metrics()
    loader.close()
    return {"tokens_per_s": n / dt, "batches": batches, "seconds": dt, "tokenizer_s": tok_s,
            "docs": m["data/docs"], "seq_len": cfg.seq_len, "micro": micro, "workers": cfg.num_workers}


def _spin(ms: float) -> None:
    """Pure Python for ``ms`` milliseconds: holds the interpreter lock like a training loop."""
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        x += 1


def compare_loaders(args) -> None:
    from scape_train.data import DataConfig, TokenizerConfig, build_tokenizer, build_train_loader

    workers = [int(w) for w in args.compare.split(",")]
    cfg = DataConfig(source="local", path=args.data, val_split=None, seq_len=args.seq,
                     tokenizer=TokenizerConfig(kind="sentencepiece", path=args.sp))
    tok = build_tokenizer(cfg)
    rates: dict[int, list[float]] = {w: [] for w in workers}
    waits: dict[int, list[float]] = {w: [] for w in workers}
    cpus: dict[int, list[float]] = {w: [] for w in workers}
    for r in range(args.rounds):
        for w in (workers if r % 2 == 0 else workers[::-1]):
            cfg.num_workers = w
            loader = build_train_loader(cfg, tok, args.micro)
            next(loader)                 # the pool's start is not timed; the queue is empty
            wait, n, t0, c0 = 0.0, 0, time.perf_counter(), time.process_time()
            for _ in range(args.batches):
                _spin(args.busy_ms)
                t1 = time.perf_counter()
                n += next(loader)[0].numel()
                wait += time.perf_counter() - t1
            rates[w].append(n / (time.perf_counter() - t0))
            cpus[w].append(1e3 * (time.process_time() - c0) / args.batches - args.busy_ms)
            waits[w].append(1e3 * wait / args.batches)
            loader.close()
            print(f"round {r} num_workers={w}: {rates[w][-1]:,.0f} tokens/s, "
                  f"waited {waits[w][-1]:.1f} ms/batch, trainer-process CPU "
                  f"{cpus[w][-1]:.0f} ms/batch", flush=True)
    base = statistics.median(rates[workers[0]])
    for w in workers:
        med = statistics.median(rates[w])
        print(f"num_workers={w}: median {med:,.0f} tokens/s ({med / base:.2f}x num_workers="
              f"{workers[0]}), median wait {statistics.median(waits[w]):.1f} ms/batch, "
              f"trainer-process CPU {statistics.median(cpus[w]):.0f} ms/batch "
              f"(micro {args.micro} x seq {args.seq}, busy {args.busy_ms} ms/batch, "
              f"{args.rounds} rounds)")


def bench_trainer(timeout_s: int) -> dict | None:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = TRAINER_CMD + [f"run_dir={run_dir}"]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"trainer did not finish in {timeout_s}s"}
        metrics = Path(run_dir) / "metrics.jsonl"
        if proc.returncode != 0 or not metrics.exists():
            tail = (proc.stderr or proc.stdout)[-600:]
            return {"error": f"trainer exited {proc.returncode}, no metrics.jsonl: {tail}"}
        rates = [r["tokens_per_s"] for r in map(json.loads, metrics.read_text().splitlines())
                 if r.get("tokens_per_s")]
        if not rates:
            return {"error": "metrics.jsonl has no tokens_per_s"}
        return {"tokens_per_s": statistics.median(rates), "samples": len(rates)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", default="", help="num_workers values to compare, e.g. 1,3")
    ap.add_argument("--data", help="--compare: a JSON-lines training file")
    ap.add_argument("--sp", help="--compare: a SentencePiece tokenizer directory")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy-ms", type=float, default=0.0)
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--no-trainer", action="store_true")
    ap.add_argument("--trainer-timeout", type=int, default=900)
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench_data.md"))
    args = ap.parse_args()
    if args.compare:
        compare_loaders(args)
        return

    loader = bench_loader(args.batches, args.micro)
    print(f"loader: {loader['tokens_per_s']:,.0f} tokens/s ({loader['batches']} batches of "
          f"{loader['micro']}x{loader['seq_len']} in {loader['seconds']:.2f}s)")
    trainer = None if args.no_trainer else bench_trainer(args.trainer_timeout)
    if trainer and "error" not in trainer:
        ratio = loader["tokens_per_s"] / trainer["tokens_per_s"]
        print(f"trainer: {trainer['tokens_per_s']:,.0f} tokens/s -> loader is {ratio:.0f}x the need")
    elif trainer:
        print(f"trainer: not measured ({trainer['error']})")

    lines = [
        "# Data loader throughput vs the trainer's need",
        "",
        f"Command: `python scripts/bench_data.py --batches {args.batches} --micro {args.micro}`",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| what | tokens/s |",
        "|---|---|",
        f"| loader alone (data=classics, trained 8k BPE, micro batch {loader['micro']}, seq "
        f"{loader['seq_len']}, num_workers {loader['workers']}) | {loader['tokens_per_s']:,.0f} |",
    ]
    if trainer and "error" not in trainer:
        lines.append(f"| trainer, default job (`{' '.join(['python'] + TRAINER_CMD[1:])} run_dir=<tmp>`), "
                     f"median of {trainer['samples']} logged values | {trainer['tokens_per_s']:,.0f} |")
        lines += ["", f"Loader / trainer: **{loader['tokens_per_s'] / trainer['tokens_per_s']:.0f}x** "
                      "(target >= 10x)."]
    else:
        lines += ["", "Trainer not measured: " + (trainer["error"] if trainer else "--no-trainer") + "."]
    lines += ["", f"BPE training or cache load before the first batch: {loader['tokenizer_s']:.1f}s "
                  "(training happens once per corpus and vocabulary size, then it is cached)."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
