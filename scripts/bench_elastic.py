"""What the elastic path costs when nothing fails: a round's wall time of elastic DiLoCo (torchft:
a lighthouse, one replica group per worker, a quorum and a vote per round) against plain DiLoCo
(one gloo group), side by side, alternated; or, with ``--strategy data_parallel``, a step of
elastic data parallelism (dense AdamW, every step a round: a quorum, the gradients' all-reduce
through torchft, a vote, the data cursor kept) against DDP on one gloo group; with
``--optimizer scape`` too, elastic SCAPE (the payload's all-reduce and the next mask's all-gather
through torchft, blocking; the rollback copy; the vote) against SCAPE on one gloo group, both at
density 0.1 from the first step; with ``--payload-dtype fp8_e4m3`` too, both with an fp8 payload
(across replica groups its all-gather form, on one gloo group the all-to-all form).

    python scripts/bench_elastic.py [--rounds 4] [--repeats 4] [--workers 3] [--inner-steps 30]
    python scripts/bench_elastic.py --strategy data_parallel [--optimizer scape] [--rounds 60]
    python scripts/bench_elastic.py --strategy data_parallel --optimizer scape --payload-dtype fp8_e4m3

Each run is ``--workers`` processes of ``python -m scape_train`` (llama_tiny, one thread each) on
this machine. A round's time is ``H`` times the mean logged ``step_time_s`` of every step after
the first round (start-up and the first quorum excluded; data parallelism: a round is a step, and
the first 10 are excluded), averaged over the workers. Prints both, their ratio per repeat, and
the machine's load; writes ``docs/figures/<section>.json`` and that section of
``docs/reliability.md``: ``bench_elastic``, ``bench_elastic_dp`` (data parallelism) or
``bench_elastic_scape`` (with SCAPE) or ``bench_elastic_scape_fp8`` (its fp8 payload).
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
       "trainer.sample_tokens=0", "logging.wandb.mode=disabled", "logging.progress_bar=false"]
DP_SKIP = 10     # data parallelism: the steps left out of the mean (start-up, the first quorums)
SCAPE = ["optimizer=scape", "optimizer.density=0.1", "optimizer.density_warmup_steps=0"]


def section(strategy: str, optimizer: str = "adamw", payload: str = "fp32") -> str:
    if strategy != "data_parallel":
        return "bench_elastic"
    if optimizer != "scape":
        return "bench_elastic_dp"
    return "bench_elastic_scape" + ("" if payload == "fp32" else f"_{payload.split('_')[0]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", **extra)


def round_seconds(run_dir: Path, h: int, skip: int) -> float:
    """``h`` x the mean ``step_time_s`` of the steps after the first ``skip``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > skip]
    return h * sum(times) / len(times)


def run(kind: str, root: Path, args) -> float:
    """One job of ``kind`` (plain | elastic); the workers' mean round time in seconds."""
    dp = args.strategy == "data_parallel"
    h, skip = (1, DP_SKIP) if dp else (args.inner_steps, args.inner_steps)
    steps = args.rounds * h
    job = [*JOB, f"trainer.max_steps={steps}", f"trainer.warmup_steps={min(40, steps // 4)}",
           *((["strategy=data_parallel"] + (
               [*SCAPE, f"optimizer.payload_dtype={args.payload_dtype}"]
               if args.optimizer == "scape" else ["optimizer=adamw"])) if dp else
             ["strategy=diloco", f"strategy.inner_steps={args.inner_steps}"])]
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
        return round_seconds(root / "plain_0", h, skip)
    per = [round_seconds(root / f"elastic_{w}", h, skip) for w in range(args.workers)]
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
    if a.get("strategy", "diloco") == "data_parallel":
        scape = a.get("optimizer", "adamw") == "scape"
        payload = a.get("payload_dtype", "fp32")
        scape_what = "SCAPE at density 0.1 from the first step" + (
            "" if payload == "fp32" else f", {payload} payload (elastic: its all-gather form)")
        what = (f"llama_tiny (seq 128, micro-batch 4), "
                f"{scape_what if scape else 'dense AdamW'}, "
                f"{a['workers']} workers of one process and one thread each on this 2-core "
                f"machine, {a['rounds']} steps (the first {DP_SKIP} excluded)")
        names = ("SCAPE, one gloo group", "elastic SCAPE") if scape else \
            ("DDP", "elastic data parallel")
        unit = "s/step"
    else:
        what = (f"llama_tiny, DiLoCo H = {a['inner_steps']}, {a['workers']} workers of one "
                f"process and one thread each on this 2-core machine, {a['rounds']} rounds (the "
                "first excluded)")
        names, unit = ("plain DiLoCo", "elastic DiLoCo"), "s/round"
    lines = [f"{what}, contenders alternated; {r['date']}, commit `{r['commit']}`, load "
             f"{r['load_before']:.1f} before the first run.", "",
             f"| repeat | {names[0]} ({unit}) | {names[1]} ({unit}) | elastic / plain | "
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
    ap.add_argument("--strategy", choices=["diloco", "data_parallel"], default="diloco")
    ap.add_argument("--optimizer", choices=["adamw", "scape"], default="adamw",
                    help="data parallelism's optimizer")
    ap.add_argument("--payload-dtype", choices=["fp32", "fp8_e4m3"],
                    default="fp32", help="SCAPE's payload (with --optimizer scape)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds (data parallelism: steps); default 4 (60)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--docs", default=str(REPO / "docs"), help="where the JSON and page go")
    args = ap.parse_args()
    if args.optimizer != "adamw" and args.strategy != "data_parallel":
        ap.error("--optimizer applies to --strategy data_parallel")
    if args.payload_dtype != "fp32" and args.optimizer != "scape":
        ap.error("--payload-dtype applies to --optimizer scape")
    if args.rounds is None:
        args.rounds = 60 if args.strategy == "data_parallel" else 4
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
            print(f"repeat {i} {kind}: {t[kind]:.3f} s per round ({args.strategy}, "
                  f"{args.workers} workers; run {time.time() - start:.0f} s; load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
        print(f"repeat {i}: elastic / plain = {t['elastic'] / t['plain']:.3f}", flush=True)
        out["repeats"].append({**t, "load": os.getloadavg()[0]})
    print(f"load after: {os.getloadavg()}")
    figures = Path(args.docs) / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    name = section(args.strategy, args.optimizer, args.payload_dtype)
    (figures / f"{name}.json").write_text(json.dumps(out, indent=1))
    print(table(out))
    import doc_sections
    doc_sections.update(name, figures=figures)


if __name__ == "__main__":
    main()
