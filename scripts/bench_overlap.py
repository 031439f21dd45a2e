#!/usr/bin/env python
"""A local-step round's exchange blocking vs overlapped with the next round
(``strategy.overlap_steps``), on 4 workers joined by slow links (scripts/netcluster, root).

    .venv/bin/python scripts/bench_overlap.py [--strategy diloco|gasloc_2peer] [--repeats 2] \
        [--rate 20mbit] [--tau 15] [--straggler-rate 20mbit --rate 200mbit]

Every run is the real trainer (``python -m scape_train``), one rank per network namespace, the
small Llama and data of ``bench_gasloc.py`` (2.6 MB per exchange), DiLoCo (an all-reduce) or
GASLoC on the 2peer graph (a gossip exchange with two peers) with H = ``--h``, ``--steps``
nominal steps, every link at ``--rate`` (with ``--straggler-rate``, rank 3's at that rate: a
bandwidth straggler, as in ``bench_gasloc.py``). The contenders, alternated in each repeat:
blocking rounds, and rounds overlapped with ``--tau`` inner steps of the next round, landing
by ``carry`` and by ``mix`` at alpha 0. Measured per run: the training time (first to last
logged step, so start-up and the tokenizer are left out), the time spent waiting for the
exchange (``comm/outer_wait_s``, GASLoC ``comm/gossip_wait_s``, summed over the logged windows,
rank 0) and the final validation loss. The ratios are taken within a repeat.
Writes docs/figures/bench_overlap.json (GASLoC: bench_overlap_gasloc.json; with a straggler,
``_straggler`` added to the name) and that section of docs/gasloc.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import bench_gasloc  # noqa: E402
import doc_sections  # noqa: E402


def contenders(tau: int) -> list[tuple[str, list[str]]]:
    return [("blocking", []),
            (f"overlap tau={tau} carry", [f"strategy.overlap_steps={tau}",
                                          "strategy.overlap_merge=carry"]),
            (f"overlap tau={tau} mix alpha=0", [f"strategy.overlap_steps={tau}",
                                                "strategy.overlap_merge=mix"])]


# --strategy: (its overrides before H, the Comm kind of its exchange, the section it writes)
STRATEGIES = {"diloco": (["strategy=diloco"], "outer", "bench_overlap"),
              "gasloc_2peer": (["strategy=gasloc", "strategy.topology=2peer"], "gossip",
                               "bench_overlap_gasloc")}
LABELS = {"diloco": "DiLoCo", "gasloc_2peer": "GASLoC 2peer"}


def section_name(strategy: str, straggler_rate: str | None) -> str:
    """The docs section (and JSON name) a run of ``strategy`` writes."""
    return STRATEGIES[strategy][2] + ("_straggler" if straggler_rate else "")


def outer_wait_s(run_dir: Path, kind: str = "outer") -> float:
    """Rank 0's time waiting for the exchange (Comm kind ``kind``) over the run: each logged
    window's per-step mean times the window's steps."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    total, last = 0.0, 0
    for r in rows:
        if f"comm/{kind}_wait_s" in r:
            total += r[f"comm/{kind}_wait_s"] * (r["step"] - last)
        if "loss" in r:
            last = r["step"]
    return total


def measure(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_args = SimpleNamespace(rate=args.rate, timeout=args.timeout, steps=args.steps, h=args.h,
                               straggler_rate=args.straggler_rate)
    overrides, kind, _ = STRATEGIES[args.strategy]
    strategy = [*overrides, f"strategy.inner_steps={args.h}"]
    runs = []
    for repeat in range(args.repeats):
        order = contenders(args.tau)
        if repeat % 2:
            order = order[::-1]
        for label, extra in order:
            name = f"r{repeat}_{label.replace(' ', '_').replace('=', '')}"
            load = os.getloadavg()[0]
            # validation at the end only: a validation's loss all-reduce at a round's end would
            # queue behind the exchange in flight (one connection per pair of ranks)
            res = bench_gasloc.run_one(name, out, run_args, strategy + extra,
                                       straggler=bool(args.straggler_rate), eval_every=0)
            runs.append({"repeat": repeat, "label": label, "load_before": round(load, 2),
                         "train_s": res["train_s"], "final_val": res["final_val"],
                         "outer_wait_s": outer_wait_s(out / name, kind)})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                            capture_output=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "scape_train"], cwd=REPO, text=True,
                           capture_output=True).stdout.strip()
    return {"args": vars(args), "runs": runs, "date": time.strftime("%Y-%m-%d"),
            "commit": commit + ("+dirty" if dirty else ""), "cpus": os.cpu_count()}


def table(res: dict) -> str:
    a = res["args"]
    label = LABELS[a.get("strategy", "diloco")]
    links = (f"links {a['rate']}, rank 3's {a['straggler_rate']}" if a.get("straggler_rate")
             else f"every link {a['rate']}")
    lines = [f"4 workers, {label} H = {a['h']}, {a['steps']} nominal steps, {links}; "
             f"{res['date']}, commit `{res['commit']}`, {res['cpus']} CPU cores.", "",
             "| repeat | run | train time (s) | vs blocking | exchange wait, rank 0 (s) "
             "| final val loss | load before |", "|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        base = next(b for b in res["runs"] if b["repeat"] == r["repeat"] and b["label"] == "blocking")
        lines.append(f"| {r['repeat']} | {r['label']} | {r['train_s']:.1f} | "
                     f"{r['train_s'] / base['train_s']:.3f} | {r['outer_wait_s']:.1f} | "
                     f"{r['final_val']:.4f} | {r['load_before']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="diloco")
    p.add_argument("--out", default=None, help="run directories (default outputs/<section>)")
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"), help="where the JSON goes")
    p.add_argument("--steps", type=int, default=600, help="nominal steps per run")
    p.add_argument("--h", type=int, default=30, help="inner steps H")
    p.add_argument("--tau", type=int, default=15, help="overlap_steps of the overlapped runs")
    p.add_argument("--rate", default="20mbit", help="every link's rate")
    p.add_argument("--straggler-rate", default=None,
                   help="rank 3's link rate (a bandwidth straggler); default: as every link")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=400.0, help="per run, seconds")
    args = p.parse_args()
    section = section_name(args.strategy, args.straggler_rate)
    args.out = args.out or str(REPO / "outputs" / section)
    res = measure(args)
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    (docs / f"{section}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    doc_sections.update(section, figures=docs)


if __name__ == "__main__":
    main()
