#!/usr/bin/env python3
"""Quality on real text: validation-loss curves of dense AdamW, dense AdamS, SCAPE-90, SCAPE-99 and
top-k AdamW at 99%, trained on identical tokens with N ranks on gloo (CPU).

Every run is the real trainer under torchrun (``python -m torch.distributed.run -m scape_train``)
with the same model, data, seed, batch and schedule; only the optimizer differs, at one lr and
one seed: a quick look. ``docs/quality.md`` reports the tuned, multi-seed comparison
(``study_quality.py``). Writes ``--report`` (table + the exact commands) and a figure beside it,
under ``outputs/bench_quality/`` by default.

    .venv/bin/python scripts/bench_quality.py                   # the documented settings
    .venv/bin/python scripts/bench_quality.py --steps 40 --only adams scape99   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RUNS = {
    "adamw": ["optimizer=adamw"],
    "adams": ["optimizer=adams"],
    "scape90": ["optimizer=scape", "optimizer.density=0.1"],
    "scape99": ["optimizer=scape", "optimizer.density=0.01"],
    "topk99": ["optimizer=topk_adamw", "optimizer.density=0.01"],
}
LABELS = {"adamw": "dense AdamW", "adams": "dense AdamS", "scape90": "SCAPE-90",
          "scape99": "SCAPE-99", "topk99": "top-k AdamW 99%"}


def common_overrides(args) -> list[str]:
    return [
        f"model={args.model}", f"trainer.max_steps={args.steps}",
        f"trainer.warmup_steps={max(1, args.steps // 10)}", f"trainer.micro_batch_size={args.micro}",
        f"trainer.eval_every={args.eval_every}", "trainer.log_every=10",
        "trainer.checkpoint_every=0", f"trainer.seed={args.seed}", f"optimizer.lr={args.lr}",
        f"optimizer.min_lr={args.lr / 10}", f"optimizer.density_warmup_steps={args.density_warmup}",
        "data=classics", f"data.seq_len={args.seq_len}", f"data.val_tokens={args.val_tokens}",
        "logging.wandb.mode=disabled", "logging.progress_bar=false",
    ]


def command(name: str, args, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.ranks}", "-m", "scape_train",
            *common_overrides(args), *RUNS[name], f"run_dir={run_dir}", f"run_name=quality_{name}"]


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def plot(curves: dict[str, list[tuple[int, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, curve in curves.items():
        ax.plot(*zip(*curve), "o-", ms=3, label=LABELS[name])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def write_report(curves, args, commands, seconds, out: Path) -> None:
    base = curves.get("adams", [(0, float("nan"))])[-1][1]
    lines = [
        "# Quality on real text: SCAPE vs dense\n",
        f"Model `{args.model}`, data `classics` (Shakespeare + King James Bible), {args.ranks} ranks "
        f"on gloo (CPU), micro-batch {args.micro} x {args.seq_len} tokens per rank, {args.steps} "
        f"steps, peak lr {args.lr} (cosine, 10% warmup), seed {args.seed}; identical tokens in "
        f"every run. SCAPE's density warms up geometrically from 1.0 over {args.density_warmup} "
        "steps. Validation: the fixed held-out set "
        f"({args.val_tokens} tokens).\n",
        "| optimizer | final val loss | vs dense AdamS | wall time (s) |",
        "|---|---|---|---|",
    ]
    for name, curve in curves.items():
        final = curve[-1][1]
        lines.append(f"| {LABELS[name]} | {final:.4f} | {final - base:+.4f} | {seconds[name]:.0f} |")
    lines += ["", "Targets (the paper's GPT-345M result): SCAPE-90 within 0.02 and SCAPE-99 within "
              "0.04 of dense AdamS.", "", f"![validation loss](figures/{out.stem}.png)", "",
              "Validation loss by step:", "", "| step | " + " | ".join(LABELS[n] for n in curves) + " |",
              "|---" * (len(curves) + 1) + "|"]
    steps = [s for s, _ in next(iter(curves.values()))]
    for i, step in enumerate(steps):
        lines.append(f"| {step} | " + " | ".join(f"{c[i][1]:.4f}" for c in curves.values()) + " |")
    lines += ["", "Commands (from the repo root; `OMP_NUM_THREADS=1`):", "", "```"]
    lines += [shlex.join(c).replace(str(REPO) + "/", "") for c in commands]
    lines += ["```", "", f"Regenerate: `{shlex.join(['.venv/bin/python', 'scripts/bench_quality.py'] + sys.argv[1:])}`", ""]
    out.write_text("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--model", default="llama_tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--val-tokens", type=int, default=16384)
    p.add_argument("--density-warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--only", nargs="*", default=list(RUNS))
    p.add_argument("--out-dir", default=str(REPO / "outputs" / "bench_quality"))
    p.add_argument("--report", default=str(REPO / "outputs" / "bench_quality" / "quality.md"))
    args = p.parse_args()

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "disabled"}
    curves, seconds, commands = {}, {}, []
    for name in args.only:
        run_dir = Path(args.out_dir) / name
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        cmd = command(name, args, run_dir)
        commands.append(cmd)
        print(f"== {name}: {shlex.join(cmd)}", flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, env=env, check=True)
        seconds[name] = time.perf_counter() - start
        curves[name] = val_curve(run_dir)
        print(f"   final val loss {curves[name][-1][1]:.4f} in {seconds[name]:.0f} s", flush=True)
    report = Path(args.report)
    plot(curves, report.parent / "figures" / f"{report.stem}.png")
    write_report(curves, args, commands, seconds, report)
    print(f"wrote {report}")


if __name__ == "__main__":
    main()
