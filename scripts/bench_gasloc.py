#!/usr/bin/env python
"""DiLoCo vs GASLoC-2peer on 4 workers joined by rate-limited links (scripts/netcluster, root).

    .venv/bin/python scripts/bench_gasloc.py [--steps 600] [--h 30] [--straggler-h 5] [--only equal]

Two comparisons, each run is the real trainer (``python -m scape_train``) on a small Llama on the
shipped classics sample, one rank per network namespace:

1. straggler: every link 200 Mbit/s except rank 3's at 20 Mbit/s (10%; rates scaled down with the
   model so that an exchange costs about as much as a round of compute, as at paper scale on
   slow links). DiLoCo with H on every worker vs GASLoC-2peer and GASLoC-1peer with adapted H_i
   (H on the fast workers, ``--straggler-h`` on the slow one, so it starts its slow exchange
   earlier). Measured: wall-clock time until the validation
   loss first reaches the target (the highest final loss of the runs, so all reach it).
2. equal bandwidth (all 200 Mbit/s): DiLoCo vs GASLoC-2peer at H: validation loss at equal steps.

Each rank runs ``python -m scape_train``. Run directories and per-rank logs go under ``--out`` (outputs/, ignored
by git); the table, results.json and bench_gasloc.png are copied to ``--docs`` (docs/figures).
About 10 minutes on 2 cores with the defaults.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import doc_sections  # noqa: E402

# ~0.7M parameters (2.7 MB per exchange): an exchange over the slow link costs about as much as
# several inner steps, which is the regime the comparison is about.
MODEL = ["model=llama_tiny", "model.n_layers=2", "model.d_model=128", "model.n_heads=4",
         "model.n_kv_heads=2", "model.ffn_dim=384", "model.max_seq_len=64", "data=classics",
         "data.seq_len=64", "data.val_tokens=4096", "data.tokenizer.vocab_size=1024"]
TRAINER = ["trainer.micro_batch_size=8", "trainer.num_threads=1", "trainer.device=cpu",
           "trainer.precision=fp32", "trainer.warmup_steps=10", "trainer.checkpoint_every=0",
           "trainer.log_every=10", "logging.wandb.mode=disabled", "logging.progress_bar=false",
           "optimizer=adamw", "optimizer.lr=3e-3", "optimizer.min_lr=3e-4"]


def run_one(name: str, out: Path, args, strategy: list[str], straggler: bool,
            eval_every: int | None = None) -> dict:
    """One run; validation every ``eval_every`` steps (default: every round, H)."""
    run_dir = out / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / "scripts" / "netcluster"), "--ranks", "4", "--rate", args.rate,
           "--timeout", str(args.timeout), "--out", str(run_dir / "logs")]
    if straggler:
        cmd += ["--straggler-rank", "3", "--straggler-rate", args.straggler_rate]
    cmd += ["--", sys.executable, "-m", "scape_train", f"run_dir={run_dir}",
            f"run_name={name}",
            f"data.tokenizer.cache_dir={out / 'tokenizer'}", f"trainer.max_steps={args.steps}",
            f"trainer.eval_every={args.h if eval_every is None else eval_every}", *MODEL, *TRAINER,
            *strategy]
    print(f"\n== {name}: {' '.join(cmd)}", flush=True)
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); logs in {run_dir / 'logs'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    t0 = min(r["time"] for r in rows)   # first logged step: excludes start-up and tokenizer
    val = [(r["step"], r["time"] - t0, r["val_loss"]) for r in rows if "val_loss" in r]
    return {"name": name, "val": val, "wall_s": time.time() - start,
            "train_s": max(r["time"] for r in rows) - t0, "final_val": val[-1][2]}


def time_to(val: list, target: float) -> float | None:
    return next((t for _, t, v in val if v <= target), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_gasloc"),
                   help="run directories and logs")
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"),
                   help="where the table, results.json and the plot are copied")
    p.add_argument("--steps", type=int, default=600, help="nominal steps per run (rounds x H)")
    p.add_argument("--h", type=int, default=30, help="inner steps H")
    p.add_argument("--straggler-h", type=int, default=5, help="the straggler's H_i in GASLoC")
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--straggler-rate", default="20mbit")
    p.add_argument("--timeout", type=float, default=400.0, help="per run, seconds")
    p.add_argument("--only", choices=["straggler", "equal"], help="run one comparison only")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    h = args.h
    diloco = ["strategy=diloco", f"strategy.inner_steps={h}"]
    gasloc = ["strategy=gasloc", "strategy.topology=2peer", f"strategy.inner_steps={h}"]
    per_worker = [f"strategy.inner_steps_per_worker=[{h},{h},{h},{args.straggler_h}]"]
    one_peer = ["strategy=gasloc", "strategy.topology=1peer", f"strategy.inner_steps={h}"]
    results: dict = {"args": vars(args)}
    if args.only != "equal":
        runs = [run_one("straggler_diloco", out, args, diloco, straggler=True),
                run_one("straggler_gasloc2peer_adapted", out, args, gasloc + per_worker, straggler=True),
                run_one("straggler_gasloc1peer_adapted", out, args, one_peer + per_worker, straggler=True)]
        target = max(r["final_val"] for r in runs)
        results["straggler"] = {"target": target, "runs": runs,
                                "time_to_target_s": {r["name"]: time_to(r["val"], target) for r in runs}}
    if args.only != "straggler":
        c = run_one("equal_diloco", out, args, diloco, straggler=False)
        d = run_one("equal_gasloc2peer", out, args, gasloc, straggler=False)
        results["equal"] = {"runs": [c, d]}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown(results, args)
    (out / "table.md").write_text(table)
    print("\n" + table)
    plot(results, out / "bench_gasloc.png")
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    for src, dst in (("bench_gasloc.png", "bench_gasloc.png"), ("table.md", "bench_gasloc_table.md"),
                     ("results.json", "bench_gasloc_results.json")):
        shutil.copyfile(out / src, docs / dst)
    print(f"copied to {docs}: bench_gasloc.png, bench_gasloc_table.md, bench_gasloc_results.json")
    doc_sections.update("bench_gasloc", figures=docs)


def markdown(results: dict, args) -> str:
    lines = [f"4 workers, {args.steps} nominal steps, H = {args.h}; links {args.rate}"
             f" (straggler rank 3: {args.straggler_rate}).", "",
             "| setting | run | final val loss | train time (s) | time to target (s) |",
             "|---|---|---|---|---|"]
    if "straggler" in results:
        s = results["straggler"]
        for r in s["runs"]:
            tt = s["time_to_target_s"][r["name"]]
            lines.append(f"| straggler (target {s['target']:.3f}) | {r['name']} | {r['final_val']:.4f} "
                         f"| {r['train_s']:.1f} | {'-' if tt is None else f'{tt:.1f}'} |")
    if "equal" in results:
        for r in results["equal"]["runs"]:
            lines.append(f"| equal bandwidth | {r['name']} | {r['final_val']:.4f} | {r['train_s']:.1f} | |")
    return "\n".join(lines) + "\n" + milestones(results, args.steps // 2)


MILESTONES = (4.9, 4.8, 4.75)   # validation losses every run passes on the way to ~4.7


def milestones(results: dict, mid_step: int) -> str:
    """Each run's time (s) to reach each of MILESTONES, and its validation loss at ``mid_step``."""
    lines = ["", "Time (s) to other losses, from the same runs:", "",
             "| run | " + " | ".join(f"to {m}" for m in MILESTONES) + f" | val loss at step {mid_step} |",
             "|---|" + "---|" * (len(MILESTONES) + 1)]
    for part in ("straggler", "equal"):
        for r in results.get(part, {}).get("runs", []):
            times = [time_to(r["val"], m) for m in MILESTONES]
            mid = next((v for s, _, v in r["val"] if s == mid_step), None)
            lines.append(f"| {r['name']} | " + " | ".join("never" if t is None else f"{t:.1f}"
                                                        for t in times)
                         + f" | {'-' if mid is None else f'{mid:.3f}'} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if "straggler" in results:
        for r in results["straggler"]["runs"]:
            axes[0].plot([t for _, t, _ in r["val"]], [v for _, _, v in r["val"]], "o-", label=r["name"])
        axes[0].axhline(results["straggler"]["target"], color="grey", ls="--", label="target")
    axes[0].set(title="one link at 10%: val loss vs wall-clock", xlabel="seconds", ylabel="val loss")
    if "equal" in results:
        for r in results["equal"]["runs"]:
            axes[1].plot([s for s, _, _ in r["val"]], [v for _, _, v in r["val"]], "o-", label=r["name"])
    axes[1].set(title="equal bandwidth: val loss vs nominal step", xlabel="step", ylabel="val loss")
    for ax in axes:
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
