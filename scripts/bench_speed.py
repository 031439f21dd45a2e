#!/usr/bin/env python
"""Per-step wall clock of dense AdamS, PowerSGD, SCAPE-90 and SCAPE-99 on 4 shaped ranks (root).

    .venv/bin/python scripts/bench_speed.py                       # everything (~25 min on 2 cores)
    .venv/bin/python scripts/bench_speed.py --rates 100mbit --opts adams,scape99 --repeats 2
    .venv/bin/python scripts/bench_speed.py --report-only         # redo table + figure from JSON

Every run is the real trainer (``python -m scape_train``) on the 18.9M-parameter ``llama_20m``
(75 MB of fp32 gradient per step: communication matters), micro-batch 1 x 128 tokens per rank (a
small compute step), one rank per network namespace (``scripts/netcluster``), links unshaped
('none'), 1 Gbit/s or 100 Mbit/s, logging every step. The first ``--skip`` steps are dropped
(start-up, DDP's first bucket rebuild, PowerSGD's vanilla all-reduce, SCAPE's synchronous first
mask); the rest are per-step samples, pooled over repeats: median and min-max.

Compute-only bound: the same 4 processes running at the same time on the same 2 cores, but as 4
independent single-process trainers (dense AdamS, the same per-rank batch), so there is no
collective at all. A single process alone would have both cores to itself and would understate
the step the 4-rank job could reach without communication; 4 concurrent copies measure exactly
the compute the cluster's ranks must do, under the same core sharing.

PowerSGD runs through ``--train`` (this file as each rank's entry): the trainer unchanged, except
that the PowerSGD strategy wraps DDP with a single gradient bucket. With several buckets, torch's
PowerSGD hook issues its P/Q all-reduces from future callbacks while the autograd thread issues the
next bucket's first all-reduce, so on gloo the ranks can issue collectives in different orders and
abort ("Received data size doesn't match expected size"; seen here on llama_20m at step 5). One
bucket leaves one chain of collectives per step, the same order on every rank.

Results merge into ``--docs``/bench_speed_results.json (so a subset can be re-run or repeated),
and the table (bench_speed_table.md) and figure (bench_speed.png) are rebuilt from all of it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_sections  # noqa: E402
from _netrun import REPO, RunResult, loadavg, run_cluster, run_independent, spread  # noqa: E402

RANKS = 4
MODEL = ["model=llama_20m", "data=classics", "data.seq_len=128", "data.val_tokens=2048",
         "trainer.micro_batch_size=1"]
TRAINER = ["trainer.log_every=1", "trainer.checkpoint_every=0", "trainer.eval_every=0",
           "trainer.num_threads=1", "trainer.device=cpu", "trainer.precision=fp32",
           "trainer.warmup_steps=2", "logging.wandb.mode=disabled", "logging.progress_bar=false"]
OPTS = {
    "adams": ["optimizer=adams"],
    # PowerSGD's hook all-reduces uncompressed until start_iter; 2 is the smallest it accepts.
    "powersgd": ["optimizer=powersgd", "optimizer.powersgd_start_iter=2"],
    "scape90": ["optimizer=scape", "optimizer.density=0.1", "optimizer.density_warmup_steps=0"],
    "scape99": ["optimizer=scape", "optimizer.density=0.01", "optimizer.density_warmup_steps=0"],
}
LABELS = {"adams": "dense AdamS (DDP)", "powersgd": "PowerSGD r4 (DDP hook)",
          "scape90": "SCAPE-90", "scape99": "SCAPE-99", "compute": "compute-only (4 x 1 proc)"}
RATES = ["none", "1gbit", "100mbit"]
FIELDS = {"step": "step_time_s", "data": "time/data_s", "fwd_bwd": "time/fwd_bwd_s",
          "optimizer": "time/optimizer_s", "comm_wait": "comm/wait_s",
          "sent_bytes": "comm/sent_bytes"}


def one_bucket_train(overrides: list[str]) -> None:
    """One rank: ``python -m scape_train`` with PowerSGD's DDP built with a single bucket."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import scape_train.optim as optim
    from scape_train.optim.powersgd import PowerSGDStrategy

    class OneBucketPowerSGD(PowerSGDStrategy):
        def wrap_model(self, model):
            if self.comm.world <= 1:
                return model
            numel = sum(p.numel() for p in model.parameters())
            self.ddp = DDP(model, process_group=self.comm.group,
                           bucket_cap_mb=4 * numel / 2**20 + 1)
            self._register_hook(self.ddp)
            return self.ddp

    optim.OPTIMIZERS["powersgd"] = OneBucketPowerSGD
    import logging

    from hydra import compose, initialize_config_dir

    from scape_train.config import register_configs, to_object
    from scape_train.train import run

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = to_object(compose(config_name="config", overrides=overrides))
    run(cfg)


def samples(res: RunResult, skip: int) -> dict[str, list[float]]:
    rows = [r for r in res.rows if r["step"] > skip and "step_time_s" in r]
    return {k: [float(r.get(f, 0.0)) for r in rows] for k, f in FIELDS.items()}


def record(res: RunResult, skip: int) -> dict:
    return {"rc": res.rc, "wall_s": res.wall_s, "load_before": res.load_before,
            "load_after": res.load_after, "command": res.command, "samples": samples(res, skip)}


def rep_of(run: dict) -> int | None:
    """The repeat a stored run belongs to (its run directory names it: ``..._r<rep>[_copy<i>]``)."""
    m = re.search(r"_r(\d+)(_copy\d+)?/run$", run["command"].split("run_dir=")[-1])
    return int(m.group(1)) if m else None


def next_rep(db: dict) -> int:
    """The first repeat number after those already stored (repeats merge into one file)."""
    reps = [rep_of(r) for runs in db.values() for r in runs]
    return max((r for r in reps if r is not None), default=-1) + 1


def per_repeat(db: dict) -> list[dict]:
    """Per link and repeat, SCAPE-99 against dense AdamS and against the compute-only block run
    beside it, from each run's median step: paired ratios, so drifting load between repeats
    cancels instead of widening a pooled spread."""
    def medians(runs, rate_tag):
        out: dict[int, list[float]] = {}
        for r in runs:
            if r["rc"] == 0 and r["samples"]["step"] and rate_tag in r["command"]:
                out.setdefault(rep_of(r), []).append(spread(r["samples"]["step"])["median"])
        return {k: statistics.median(v) for k, v in out.items()}

    rows = []
    for rate in RATES:
        comp = medians(db.get("compute", []), f"/compute_{rate}_r")
        dense = medians(db.get(f"{rate}/adams", []), "")
        scape = medians(db.get(f"{rate}/scape99", []), "")
        for rep in sorted(set(dense) & set(scape)):
            rows.append({"link": rate, "rep": rep, "adams_s": dense[rep], "scape99_s": scape[rep],
                         "compute_s": comp.get(rep), "speedup": dense[rep] / scape[rep],
                         "vs_compute": scape[rep] / comp[rep] if rep in comp else None})
    return rows


def repeat_table(rows: list[dict]) -> str:
    lines = ["| link | repeat | dense AdamS s | SCAPE-99 s | compute-only s (block) | "
             "SCAPE-99 speed-up | SCAPE-99 vs compute-only |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        comp = "-" if r["compute_s"] is None else f"{r['compute_s']:.3f}"
        vs = "-" if r["vs_compute"] is None else f"{r['vs_compute']:.2f}x"
        lines.append(f"| {r['link']} | {r['rep']} | {r['adams_s']:.3f} | {r['scape99_s']:.3f} | "
                     f"{comp} | {r['speedup']:.2f}x | {vs} |")
    for rate in RATES:
        mine = [r for r in rows if r["link"] == rate]
        if mine:
            vs = [r["vs_compute"] for r in mine if r["vs_compute"] is not None]
            lines.append(f"| {rate} | median of {len(mine)} | | | | "
                         f"{statistics.median(r['speedup'] for r in mine):.2f}x | "
                         f"{statistics.median(vs):.2f}x |" if vs else "")
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace, db: dict) -> None:
    out = Path(args.out)
    steps = [f"trainer.max_steps={args.steps}"]
    first = next_rep(db)
    for rep in range(first, first + args.repeats):
        for rate in args.rates:
            # The compute-only bound is re-measured beside every block of runs: the machine's
            # load from other jobs drifts, and the bound must be taken under the same load.
            if args.compute:
                runs = run_independent(f"compute_{rate}_r{rep}",
                                       MODEL + TRAINER + steps + OPTS["adams"], out, copies=RANKS)
                for res in runs:
                    db.setdefault("compute", []).append(record(res, args.skip))
                print(f"compute-only ({rate} block) rep {rep}: load {runs[0].load_before:.1f}->"
                      f"{runs[0].load_after:.1f}", flush=True)
            # the contenders alternate: each repeat starts one later in the list, so no optimizer
            # always runs first (or last) in a block while the load drifts
            turn = rep % len(args.opts)
            for opt in args.opts[turn:] + args.opts[:turn]:
                name = f"{rate}_{opt}_r{rep}"
                entry = ([sys.executable, str(Path(__file__).resolve()), "--train"]
                         if opt == "powersgd" else None)
                res = run_cluster(name, MODEL + TRAINER + steps + OPTS[opt], out, ranks=RANKS,
                                  rate=rate, entry=entry)
                rec = record(res, args.skip)
                db.setdefault(f"{rate}/{opt}", []).append(rec)
                med = spread(rec["samples"]["step"])["median"]
                print(f"{name}: rc={res.rc} step median {med:.3f}s wall {res.wall_s:.0f}s "
                      f"load {res.load_before:.1f}->{res.load_after:.1f}", flush=True)
                save(db, args)


def pooled(db: dict, key: str) -> dict[str, dict[str, float]]:
    runs = [r for r in db.get(key, []) if r["rc"] == 0 and r["samples"]["step"]]
    out = {k: spread([v for r in runs for v in r["samples"][k]]) for k in FIELDS}
    out["runs"] = {"n": len(runs), "loads": [(r["load_before"], r["load_after"]) for r in runs]}
    # The median of each run, to show run-to-run spread besides the per-step spread.
    out["run_medians"] = [spread(r["samples"]["step"])["median"] for r in runs]
    return out


def summarise(db: dict) -> dict:
    summ = {"compute": pooled(db, "compute")}
    # The compute-only runs measured beside each rate's block (their run directory names it).
    for rate in RATES:
        block = [r for r in db.get("compute", []) if f"/compute_{rate}_r" in r["command"]]
        if block:
            summ[f"compute/{rate}"] = pooled({"x": block}, "x")
    for rate in RATES:
        for opt in OPTS:
            if f"{rate}/{opt}" in db:
                summ[f"{rate}/{opt}"] = pooled(db, f"{rate}/{opt}")
    return summ


def fmt(s: dict[str, float], unit: float = 1.0, prec: int = 2) -> str:
    if not s.get("n"):
        return "-"
    return (f"{s['median'] / unit:.{prec}f} ({s['min'] / unit:.{prec}f}-"
            f"{s['max'] / unit:.{prec}f})")


def block_compute(summ: dict, rate: str) -> float:
    """The compute-only step measured beside this rate's runs (else all compute-only runs)."""
    return summ.get(f"compute/{rate}", summ["compute"])["step"]["median"]


def table(summ: dict) -> str:
    lines = [
        "| link | optimizer | step s | data+fwd/bwd s | optimizer s | of which comm wait s "
        "| sent MB/step/rank | vs compute-only | speed-up vs AdamS | runs, load |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    c = summ["compute"]
    if c["step"]["n"]:
        lines.append(f"| all | {LABELS['compute']} | {fmt(c['step'])} | {fmt(c['fwd_bwd'])} | "
                     f"{fmt(c['optimizer'])} | 0 | 0 | - | - | {c['runs']['n']} procs, "
                     f"{_loads(c)} |")
    for rate in RATES:
        c = summ.get(f"compute/{rate}")
        if c:
            lines.append(f"| {rate} block | {LABELS['compute']} | {fmt(c['step'])} | "
                         f"{fmt(c['fwd_bwd'])} | {fmt(c['optimizer'])} | 0 | 0 | 1.00x | - | "
                         f"{c['runs']['n']} procs, {_loads(c)} |")
        base = summ.get(f"{rate}/adams", {}).get("step", {}).get("median")
        for opt in OPTS:
            s = summ.get(f"{rate}/{opt}")
            if not s or not s["step"]["n"]:
                continue
            step, comp = s["step"]["median"], block_compute(summ, rate)
            fb = {k: s["fwd_bwd"][k] + s["data"]["median"] for k in ("median", "min", "max")}
            fb["n"] = 1
            speed = f"{base / step:.2f}x" if base else "-"
            lines.append(
                f"| {rate} | {LABELS[opt]} | {fmt(s['step'])} | {fmt(fb)} | {fmt(s['optimizer'])} "
                f"| {fmt(s['comm_wait'])} | {s['sent_bytes']['median'] / 1e6:.2f} | "
                f"{step / comp:.2f}x | {speed} | {s['runs']['n']}, {_loads(s)} |")
    return "\n".join(lines) + "\n"


def _loads(s: dict) -> str:
    return ", ".join(f"{a:.1f}->{b:.1f}" for a, b in s["runs"]["loads"][:3])


def figure(summ: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RATES), figsize=(13, 4.2), sharey=False)
    for ax, rate in zip(axes, RATES):
        comp = block_compute(summ, rate)
        names, parts = [], []
        for opt in OPTS:
            s = summ.get(f"{rate}/{opt}")
            if not s or not s["step"]["n"]:
                continue
            fb = s["data"]["median"] + s["fwd_bwd"]["median"]
            wait = s["comm_wait"]["median"]
            local = max(0.0, s["optimizer"]["median"] - wait)
            rest = max(0.0, s["step"]["median"] - fb - local - wait)
            names.append(LABELS[opt].split(" (")[0])
            parts.append((fb, local, wait, rest))
        x = range(len(names))
        bottom = [0.0] * len(names)
        for i, (lab, col) in enumerate([("data + fwd/bwd (dense: incl. DDP all-reduce)", "C0"),
                                        ("optimizer local + sync", "C2"),
                                        ("counted comm wait", "C3"), ("other", "C7")]):
            vals = [p[i] for p in parts]
            ax.bar(x, vals, bottom=bottom, color=col, label=lab)
            bottom = [b + v for b, v in zip(bottom, vals)]
        if comp == comp:  # not NaN
            ax.axhline(comp, color="k", ls="--", lw=1, label="compute-only step")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_title(f"4 ranks, link {'unlimited' if rate == 'none' else rate}")
        ax.set_ylabel("seconds per step (median)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.suptitle("llama_20m (18.9M), 1 x 128 tokens per rank, 2 shared CPU cores")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


def save(db: dict, args: argparse.Namespace) -> None:
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "bench_speed_results.json").write_text(json.dumps(db, indent=1))


def report(db: dict, args: argparse.Namespace) -> None:
    docs = Path(args.docs)
    summ = summarise(db)
    (docs / "bench_speed_summary.json").write_text(json.dumps(summ, indent=1))
    (docs / "bench_speed_table.md").write_text(table(summ))
    reps = repeat_table(per_repeat(db))
    (docs / "bench_speed_repeats.md").write_text(reps)
    figure(summ, docs / "bench_speed.png")
    print(table(summ))
    print(reps)
    doc_sections.update("bench_speed", figures=docs)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--train":
        one_bucket_train(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default=",".join(RATES))
    p.add_argument("--opts", default=",".join(OPTS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=3, help="first steps left out (warm-up)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-compute", dest="compute", action="store_false",
                   help="skip the compute-only runs")
    p.add_argument("--fresh", action="store_true", help="discard earlier results in --docs")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_speed"))
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"))
    args = p.parse_args()
    args.rates = [r for r in args.rates.split(",") if r]
    args.opts = [o for o in args.opts.split(",") if o]
    bad = [o for o in args.opts if o not in OPTS]
    if bad:
        p.error(f"unknown optimizer(s) {bad}; choose from {list(OPTS)}")
    path = Path(args.docs) / "bench_speed_results.json"
    db = {} if args.fresh or not path.exists() else json.loads(path.read_text())
    if not args.report_only:
        print(f"load before: {loadavg():.2f}", flush=True)
        measure(args, db)
        save(db, args)
    report(db, args)


if __name__ == "__main__":
    main()
