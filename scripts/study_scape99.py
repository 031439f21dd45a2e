#!/usr/bin/env python3
"""The SCAPE-99 search: which SCAPE-99 setting matches dense AdamS at SCAPE-99's communication?

The convergence study's setup (``study_quality.py``: the ``study`` model on ``data=classics``,
4 gloo ranks, seeds 1000+k, 3000 steps, lr warm-up 10% then cosine to lr/10). Each candidate is
a SCAPE configuration (density, payload format, density-schedule shape, start step, cooldown,
each as a fraction of the run) at one lr. Every run records the data bytes rank 0 sent over the
whole run (``comm/total_sent_bytes``), so candidates compare at equal communication: the budget
is 1.1x the bytes of SCAPE-99 with an fp32 payload and the study's schedule (geometric warm-up
over 10%).

Two stages: ``screen`` runs each candidate on seed 0; ``confirm`` runs the named candidates (and
dense AdamS) on seeds 0..N-1 for paired gaps with 95% t-intervals. Finished runs are skipped.

    .venv/bin/python scripts/study_scape99.py --dry-run
    .venv/bin/python scripts/study_scape99.py --screen adams scape99 s99_bf16_d02 ...
    .venv/bin/python scripts/study_scape99.py --confirm s99_fp8_d04 --seeds 3
    .venv/bin/python scripts/study_scape99.py --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_quality as sq  # noqa: E402

REPO = sq.REPO
import doc_sections  # noqa: E402

BEGIN, END = doc_sections.markers("study_scape99")
STEPS = 3000
BUDGET = 1.1            # x the reference's bytes
REFERENCE = "scape99"   # SCAPE-99, fp32 payload, geometric warm-up over 10% of the run
BASELINE = "adams"
MARGIN = 0.04
SHAPE = "study"         # the search's model (study_quality.SHAPES); others are scale checks


@dataclass(frozen=True)
class Candidate:
    name: str
    label: str
    lr: float
    optimizer: str = "scape"
    density: float = 0.01
    payload: str = "fp32"
    shape: str = "geometric"
    warmup: float = 0.1          # fractions of the run
    start: float = 0.0
    cooldown: float = 0.0
    rank: int = 4                # PowerSGD's
    hysteresis: float = 0.0      # optimizer.mask_hysteresis (ours, opt-in)
    strategy: str = "data_parallel"   # or local-step training: diloco, gasloc, sparseloco
    inner_steps: int = 30        # their H
    fragments: int = 1           # DiLoCo's: Streaming DiLoCo's F
    error_feedback: float = 0.0  # DiLoCo's quantized outer gradients: strategy.outer_error_feedback

    def overrides(self, steps: int) -> list[str]:
        if self.strategy != "data_parallel":
            # SparseLoCo's values and DiLoCo's outer gradients take SCAPE's payload codecs
            # (fp32 by default)
            key = "sparse_payload_dtype" if self.strategy == "sparseloco" else "outer_payload_dtype"
            return [f"optimizer={self.optimizer}", f"strategy={self.strategy}",
                    f"strategy.inner_steps={self.inner_steps}",
                    *([f"strategy.{key}={self.payload}"] if self.payload != "fp32" else []),
                    *([f"strategy.fragments={self.fragments}"] if self.fragments != 1 else []),
                    *([f"strategy.outer_error_feedback={self.error_feedback:g}"]
                      if self.error_feedback else [])]
        if self.optimizer == "powersgd":
            return ["optimizer=powersgd", f"optimizer.powersgd_rank={self.rank}"]
        if self.optimizer not in ("scape", "topk_adamw"):
            return [f"optimizer={self.optimizer}"]
        # top-k AdamW sparsifies on the same density schedule; only SCAPE has a payload format
        return [f"optimizer={self.optimizer}", f"optimizer.density={self.density:g}",
                *([f"optimizer.payload_dtype={self.payload}"] if self.optimizer == "scape" else []),
                f"optimizer.density_schedule={self.shape}",
                f"optimizer.density_warmup_steps={round(self.warmup * steps)}",
                f"optimizer.density_start_step={round(self.start * steps)}",
                f"optimizer.density_cooldown_steps={round(self.cooldown * steps)}",
                *([f"optimizer.mask_hysteresis={self.hysteresis:g}"] if self.hysteresis else [])]


def _s(name, label, lr, **kw) -> Candidate:
    return Candidate(name, label, lr, **kw)


CANDIDATES = {c.name: c for c in [
    _s("adams", "dense AdamS", 1e-3, optimizer="adams"),
    _s("scape99", "SCAPE-99 (fp32, geometric 10%)", 4e-3),
    # the schedule at SCAPE-99's bytes: half the warm-up, the other half as a cooldown
    _s("s99_geo5_cool5", "SCAPE-99, geometric 5% + cooldown 5%", 4e-3, warmup=0.05, cooldown=0.05),
    # the authors' shape (over budget: ~2x the warm-up's bytes)
    _s("s99_lin10", "SCAPE-99, linear 10%", 4e-3, shape="linear"),
    _s("s99_geo30", "SCAPE-99, geometric 30%", 4e-3, warmup=0.3),
    _s("s99_start5", "SCAPE-99, dense 5%, then geometric 5%", 4e-3, start=0.05, warmup=0.05),
    # more density in the same bytes: a narrower payload
    _s("s99_bf16_d02", "d 0.02, bf16 payload", 4e-3, density=0.02, payload="bf16"),
    _s("s99_fp8_d04", "d 0.04, fp8 payload", 4e-3, density=0.04, payload="fp8_e4m3"),
    _s("s99_fp8_d04_lr2", "d 0.04, fp8 payload", 2e-3, density=0.04, payload="fp8_e4m3"),
    _s("s99_fp8_d03_cool5", "d 0.03, fp8 payload, geometric 5% + cooldown 5%", 4e-3,
       density=0.03, payload="fp8_e4m3", warmup=0.05, cooldown=0.05),
    _s("s99_bf16_d02_cool5", "d 0.02, bf16 payload, geometric 5% + cooldown 5%", 4e-3,
       density=0.02, payload="bf16", warmup=0.05, cooldown=0.05),
    # the geometric warm-up sends ~70% of SCAPE-99's payload bytes (10% of the steps at a mean
    # density of 0.215): without it the same bytes buy a much denser mask
    _s("s99_fp8_d10_now", "d 0.1, fp8 payload, no warm-up", 2e-3, density=0.1,
       payload="fp8_e4m3", warmup=0.0),
    _s("s99_fp8_d10_now_lr1", "d 0.1, fp8 payload, no warm-up", 1e-3, density=0.1,
       payload="fp8_e4m3", warmup=0.0),
    _s("s99_fp8_d10_now_lr4", "d 0.1, fp8 payload, no warm-up", 4e-3, density=0.1,
       payload="fp8_e4m3", warmup=0.0),
    _s("s99_bf16_d05_now", "d 0.05, bf16 payload, no warm-up", 2e-3, density=0.05,
       payload="bf16", warmup=0.0),
    _s("s99_fp32_d03_now", "d 0.03, fp32 payload, no warm-up", 4e-3, density=0.03, warmup=0.0),
    _s("s99_fp8_d08_geo3", "d 0.08, fp8 payload, geometric 3%", 2e-3, density=0.08,
       payload="fp8_e4m3", warmup=0.03),
    # ours (opt-in, not in the spec): the next mask's statistic |c|·(1+γ) on the current mask,
    # so fewer coordinates swap (each that (re)enters takes a 0.45·lr step at β2 = 0.95)
    _s("s99_hyst1", "SCAPE-99 (fp32, geometric 10%), mask hysteresis 1", 4e-3, hysteresis=1.0),
    _s("s99_fp8_d01_now_hyst1", "d 0.01, fp8 payload, no warm-up, mask hysteresis 1", 4e-3,
       payload="fp8_e4m3", warmup=0.0, hysteresis=1.0),
    _s("s99_fp8_d10_now_hyst1", "d 0.1, fp8 payload, no warm-up, mask hysteresis 1", 2e-3,
       density=0.1, payload="fp8_e4m3", warmup=0.0, hysteresis=1.0),
    # the frontier: each family at its best lr of the convergence study; SCAPE without a density
    # warm-up at lr 2e-3 from d 0.05 up (the screens' best) and 4e-3 below (SCAPE-99's best)
    _s("adamw", "dense AdamW", 2e-3, optimizer="adamw"),
    _s("topk99", "top-k AdamW 99%, geometric 10%", 2e-3, optimizer="topk_adamw"),
    _s("powersgd4", "PowerSGD rank 4", 1e-3, optimizer="powersgd"),
    _s("scape90", "SCAPE-90 (fp32, geometric 10%)", 1e-3, density=0.1),
    *(_s(f"f_{p}_d{round(d * 100):02d}", f"d {d:g}, {p} payload, no warm-up",
         2e-3 if d >= 0.05 else 4e-3, density=d, payload=p, warmup=0.0)
      for d in (0.1, 0.05, 0.02, 0.01) for p in ("fp32", "bf16", "fp8_e4m3")),
    # local-step training (inner AdamW at dense AdamW's lr; a dense exchange every H steps)
    *(_s(f"{st}_h{h}", f"{'DiLoCo' if st == 'diloco' else 'GASLoC (2 peers)'}, H = {h}", 2e-3,
         optimizer="adamw", strategy=st, inner_steps=h)
      for st in ("diloco", "gasloc") for h in (30, 10)),
    # SparseLoCo: the top 64 of every 4096 values of each worker's error feedback, all-gathered
    # every H steps, outer lr 1 and no outer momentum (its paper's); inner AdamW
    _s("sparseloco_h10", "SparseLoCo (64 of 4096, fp32), H = 10", 1e-3, optimizer="adamw",
       strategy="sparseloco", inner_steps=10),
    # at H = 30, in its paper's range; the grid's centre is H = 10's best lr
    _s("sparseloco_h30", "SparseLoCo (64 of 4096, fp32), H = 30", 2e-3, optimizer="adamw",
       strategy="sparseloco", inner_steps=30),
    # Streaming DiLoCo at DiLoCo H = 30's bytes: 3 fragments, one every 10 steps; the grid's
    # centre is DiLoCo H = 30's best lr
    _s("streaming_h30_f3", "Streaming DiLoCo, H = 30, 3 fragments", 2.5e-4, optimizer="adamw",
       strategy="diloco", inner_steps=30, fragments=3),
    _s("sparseloco_h10_fp8", "SparseLoCo (64 of 4096, fp8), H = 10", 2e-3, optimizer="adamw",
       strategy="sparseloco", inner_steps=10, payload="fp8_e4m3"),
    # Streaming DiLoCo's 4-bit outer gradients (E2M1 with power-of-two block scales)
    _s("streaming_h30_f3_fp4", "Streaming DiLoCo, H = 30, 3 fragments, fp4 outer gradients",
       2.5e-4, optimizer="adamw", strategy="diloco", inner_steps=30, fragments=3,
       payload="fp4_e2m1"),
    # ... with each worker's rounding fed back into its next round (beta 1)
    _s("streaming_h30_f3_fp4_ef", "Streaming DiLoCo, H = 30, 3 fragments, fp4 outer gradients "
       "with error feedback", 2.5e-4, optimizer="adamw", strategy="diloco", inner_steps=30,
       fragments=3, payload="fp4_e2m1", error_feedback=1.0),
    _s("sparseloco_h10_fp4", "SparseLoCo (64 of 4096, fp4), H = 10", 2e-3, optimizer="adamw",
       strategy="sparseloco", inner_steps=10, payload="fp4_e2m1"),
]}
# frontier points that an earlier screen already ran under another name
FRONTIER_ALIASES = {"f_fp8_e4m3_d10": "s99_fp8_d10_now", "f_bf16_d05": "s99_bf16_d05_now"}
F_BEGIN, F_END = doc_sections.markers("study_frontier")
S_BEGIN, S_END = doc_sections.markers("study_scale")
PAYLOADS = ("fp32", "bf16", "fp8_e4m3")
DENSITIES = (0.1, 0.05, 0.02, 0.01)
# the families of the frontier: (label, candidates); SCAPE per payload across the densities
FAMILIES = [("dense", ["adams", "adamw"]),
            ("SCAPE, paper schedule (geometric warm-up 10%)", ["scape90", "scape99"]),
            *((f"SCAPE {p}, no warm-up", [f"f_{p}_d{round(d * 100):02d}" for d in DENSITIES])
              for p in PAYLOADS),
            ("top-k AdamW", ["topk99"]), ("PowerSGD", ["powersgd4"])]


def run_id(c: Candidate, seed: int, steps: int, shape: str = SHAPE) -> str:
    return f"{c.name}_lr{c.lr:g}_s{seed}_h{steps}" + ("" if shape == SHAPE else f"_{shape}")


def command(c: Candidate, seed: int, steps: int, ranks: int, run_dir: Path, extra,
            shape: str = SHAPE, checkpoint_every: int = 0) -> list[str]:
    """The run's trainer command; with ``checkpoint_every`` it checkpoints and resumes
    (``resume=auto``: the last checkpoint in ``run_dir``, or a fresh start without one)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}", "-m", "scape_train",
            *sq.common_overrides(steps, c.lr, seed, shape, checkpoint_every), *c.overrides(steps),
            *extra, f"run_dir={run_dir}", f"run_name=s99_{run_id(c, seed, steps, shape)}",
            *(["resume=auto"] if checkpoint_every else [])]


def started_code(run_dir: Path, rid: str, resume: bool) -> dict:
    """The code a run executes (``study_quality.code_state``), kept in ``run_dir/code.json`` at
    its first start with the wall time of its earlier attempts; a resume at other code than the
    run started with is refused (one run, one commit)."""
    now = sq.code_state()
    path = run_dir / "code.json"
    if resume and path.exists():
        started = json.loads(path.read_text())
        if (started["commit"], started["dirty"]) != (now["commit"], now["dirty"]):
            raise RuntimeError(
                f"{rid} started at commit {started['commit']}{' (dirty)' * started['dirty']} and "
                f"this worktree is at {now['commit']}{' (dirty)' * now['dirty']}: resume it from a "
                f"worktree at its commit, or delete {run_dir} to run it again here")
        return started
    run_dir.mkdir(parents=True, exist_ok=True)
    code = {**now, "wall_s_before": 0.0}
    sq.write_atomic(path, json.dumps(code))
    return code


def execute(c: Candidate, seed: int, steps: int, ranks: int, runs_dir: Path, extra,
            shape: str = SHAPE, checkpoint_every: int = 0) -> dict:
    """Run (or, with ``checkpoint_every``, resume) one run and write its ``result.json``."""
    rid = run_id(c, seed, steps, shape)
    run_dir = runs_dir / rid
    resume = checkpoint_every > 0
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    cmd = command(c, seed, steps, ranks, run_dir / "train", extra, shape, checkpoint_every)
    code = started_code(run_dir, rid, resume)
    segment = 0.0
    try:
        segment, diverged = sq.run_trainer(cmd, run_dir, rid, resume=resume)
    except sq.Stopped as stop:      # a stopped segment's time counts in the run's wall time too
        segment = stop.wall_s
        raise
    finally:
        wall = code["wall_s_before"] + segment
        sq.write_atomic(run_dir / "code.json", json.dumps({**code, "wall_s_before": wall}))
    metrics = run_dir / "train" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line] \
        if metrics.exists() else []
    val = sq.series(rows, "val_loss")
    if not diverged and (not val or val[-1][0] != steps):
        raise RuntimeError(f"{rid}: no final validation loss at step {steps}")
    result = {"id": rid, "candidate": c.name, "label": c.label, "lr": c.lr, "seed": seed,
              "steps": steps, "shape": shape, "settings": c.overrides(steps),
              "final_val_loss": None if diverged else val[-1][1], "diverged": diverged,
              "sent_bytes": sq.run_sent_bytes(rows), "val_loss": val,
              "train_loss": sq.series(rows, "loss"),
              "density_series": sq.series(rows, "scape/density"),
              "residual_norm": sq.series(rows, "scape/residual_norm"),
              "mask_overlap": sq.series(rows, "scape/mask_overlap"),
              "total_sent_series": sq.series(rows, "comm/total_sent_bytes"),
              "wall_s": round(wall, 2), "command": shlex.join(cmd).replace(str(REPO) + "/", ""),
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "commit": code["commit"], "dirty": code["dirty"]}
    shutil.rmtree(run_dir / "train" / "checkpoints", ignore_errors=True)
    sq.write_atomic(run_dir / "result.json", json.dumps(result, indent=1))
    print(f"   {rid}: final val loss {result['final_val_loss']}, "
          f"{(result['sent_bytes'] or 0) / 1e6:.1f} MB sent, {wall:.0f} s", flush=True)
    return result


# ------------------------------------------------------------------------------ the report

def finals(results, name: str) -> dict[int, float]:
    return {r["seed"]: r["final_val_loss"] for r in results.values()
            if r["candidate"] == name and r["final_val_loss"] is not None}


def runs_of(results, name: str) -> list[dict]:
    return [r for r in results.values() if r["candidate"] == name]


def _paired(a: list[dict], b: list[dict], what: str, seeds=None) -> dict | None:
    """``study_quality.paired``, or ``{"refused": why}`` where it refuses to pair runs of
    different commits (the report then shows no gap for them, and says why)."""
    try:
        return sq.paired(a, b, what, seeds=seeds)
    except sq.MixedCommitsError as err:
        return {"refused": str(err)}


def gaps_to_baseline(results, name: str) -> tuple[dict | None, dict | None]:
    """(seed 0's gap, the paired gap over every seed) of ``name`` to dense AdamS, each pairing
    only runs of one commit (:func:`_paired`)."""
    runs, base = runs_of(results, name), runs_of(results, BASELINE)
    what = f"{name} vs {BASELINE}"
    return (_paired(runs, base, what + ", seed 0", seeds=[0]),
            _paired(runs, base, what) if name != BASELINE else None)


def gap_fields(g0: dict | None, paired: dict | None) -> dict:
    """A row's gap fields: seed 0's gap (None where not paired), the refusal where its pairing
    was refused, and the paired gap over every seed."""
    return {"gap_seed0": g0["mean"] if g0 and "mean" in g0 else None,
            **({"gap_seed0_refused": g0["refused"]} if g0 and "refused" in g0 else {}),
            "paired": paired}


REFUSED = "refused: runs of different commits"


def gap_cell(row: dict) -> str:
    return REFUSED if row.get("gap_seed0_refused") else (
        "n/a" if row["gap_seed0"] is None else f"{row['gap_seed0']:+.4f}")


def paired_cell(p: dict | None) -> str:
    if p and "refused" in p:
        return REFUSED
    return "" if not p or p["lo"] is None else \
        f"{p['mean']:+.4f} [{p['lo']:+.4f}, {p['hi']:+.4f}] ({p['n']})"


def summarize(results: dict[str, dict]) -> dict:
    ref_bytes = next((r["sent_bytes"] for r in results.values()
                      if r["candidate"] == REFERENCE and r["seed"] == 0), None)
    rows = []
    frontier_only = {n for _, names in FAMILIES for n in names} - {BASELINE, REFERENCE}
    for name, c in CANDIDATES.items():
        if name in frontier_only:
            continue
        f = finals(results, name)
        runs = runs_of(results, name)
        if not runs:
            continue
        sent = runs[0]["sent_bytes"]
        rows.append({"candidate": name, "label": c.label, "lr": c.lr,
                     "settings": runs[0]["settings"], "seeds": sorted(f),
                     "seed0": f.get(0), **gap_fields(*gaps_to_baseline(results, name)),
                     "sent_bytes": sent,
                     "bytes_vs_ref": sent / ref_bytes if sent and ref_bytes else None,
                     "diverged": any(r["diverged"] for r in runs)})
    return {"reference_bytes": ref_bytes, "rows": rows}


def render(summary: dict, fig_rel: str) -> str:
    def g(v, fmt="+.4f"):
        return "n/a" if v is None else format(v, fmt)

    lines = [BEGIN, "", "## The SCAPE-99 search", "",
             f"The convergence study's setup at {STEPS} steps (4 gloo ranks, the `study` model, "
             "seed k = data and init seed 1000+k). Bytes are the data bytes rank 0 sent over the "
             "whole run (`comm/total_sent_bytes`: payload, masks, parameters; not the control "
             f"scalars); the budget is {BUDGET}x SCAPE-99's with an fp32 payload and the study's "
             "geometric warm-up over 10%. Gaps are to dense AdamS on the same seed.", "",
             "| candidate | lr | seed 0 final val loss | gap to AdamS, seed 0 | paired gap [95% CI] "
             "(seeds) | MB sent per rank | x SCAPE-99's bytes | in budget |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(summary["rows"], key=lambda r: (r["seed0"] is None, r["seed0"] or 0)):
        ratio = r["bytes_vs_ref"]
        inb = "" if ratio is None or r["candidate"] == BASELINE else \
            ("yes" if ratio <= BUDGET else "no")
        lines.append(f"| {r['label']} (`{r['candidate']}`) | {r['lr']:g} | "
                     f"{'diverged' if r['diverged'] else g(r['seed0'], '.4f')} | "
                     f"{gap_cell(r)} | {paired_cell(r['paired'])} | "
                     f"{g(None if r['sent_bytes'] is None else r['sent_bytes'] / 1e6, '.1f')} | "
                     f"{g(ratio, '.2f')} | {inb} |")
    lines += ["", f"![final loss against bytes]({fig_rel}/scape99_search.png)", "",
              f"Every run's settings, curves, bytes and command: `{fig_rel}/scape99_search.json`. "
              "Regenerate: `.venv/bin/python scripts/study_scape99.py --report-only`; the runs: "
              "`--screen NAME...` (seed 0), `--confirm NAME... --seeds 3`.", "", END]
    return "\n".join(lines) + "\n"


def _axes(size: tuple[float, float], ncols: int = 1):
    """A figure and its axes (a row of ``ncols``), drawn without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size, dpi=110)


def plot(summary: dict, path: Path) -> None:
    fig, ax = _axes((7.5, 4.5))
    for r in summary["rows"]:
        if r["seed0"] is None or not r["sent_bytes"]:
            continue
        ax.scatter(r["sent_bytes"] / 1e6, r["seed0"], s=24)
        ax.annotate(r["candidate"], (r["sent_bytes"] / 1e6, r["seed0"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    if summary["reference_bytes"]:
        ax.axvline(BUDGET * summary["reference_bytes"] / 1e6, ls="--", lw=1, color="gray",
                   label=f"budget: {BUDGET}x SCAPE-99's bytes")
    ax.set_xscale("log")
    ax.set(xlabel="MB sent per rank over the run (log)", ylabel="final validation loss (seed 0)",
           title=f"SCAPE-99 search, {STEPS} steps")
    sq._save_figure(fig, [ax], path)


OTHER_SETTINGS = "SCAPE, the search's other settings"


def _constant_bytes(c: Candidate) -> bool:
    """Whether every step of ``c`` sends the same bytes (no density warm-up, start or cooldown)."""
    return c.optimizer not in ("scape", "topk_adamw") or (
        c.warmup == 0 and c.start == 0 and c.cooldown == 0) or c.shape == "constant"


def steady_step_bytes(run: dict, results) -> tuple[float | None, str | None]:
    """(bytes rank 0 sends per step once the density schedule has settled, where they come from).
    From the run's ``total_sent_series`` over its steady steps (after the warm-up, before a
    cooldown); else, for a run whose steps all send alike, its total over its steps; else the
    same from a run of a constant-bytes setting of the same optimizer, density and payload at the
    same steps and model (what the steady steps send); else unknown."""
    c = CANDIDATES[run["candidate"]]
    steps = run["steps"]
    series = run.get("total_sent_series") or []
    if c.optimizer in ("scape", "topk_adamw"):
        lo = round((c.start + c.warmup) * steps) + 1
        hi = steps - round(c.cooldown * steps)
    else:
        lo, hi = 1, steps
    inside = [(st, v) for st, v in series if lo <= st <= hi]
    if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
        (a, va), (b, vb) = inside[0], inside[-1]
        return (vb - va) / (b - a), "the run's steady steps"
    if _constant_bytes(c) and run.get("sent_bytes"):
        return run["sent_bytes"] / steps, "the run's total over its steps"
    for r in results.values():
        o = CANDIDATES.get(r["candidate"])
        if (o and _constant_bytes(o) and o.optimizer == c.optimizer and o.density == c.density
                and o.payload == c.payload and r["steps"] == steps
                and r.get("shape", SHAPE) == run.get("shape", SHAPE) and r.get("sent_bytes")):
            return r["sent_bytes"] / steps, f"`{o.name}` (the same density and payload, " \
                                             "no warm-up)"
    return None, None


def frontier_names(results) -> list[tuple[str, str]]:
    """(family, candidate) of every frontier point: the families' settings, then every other
    setting the search ran (a point any budget may be best at), each once (aliases resolved)."""
    named = [(family, name) for family, names in FAMILIES for name in names]
    taken = {FRONTIER_ALIASES.get(n, n) for _, n in named}
    others = sorted({r["candidate"] for r in results.values()} - taken)
    return named + [(OTHER_SETTINGS, n) for n in others if n in CANDIDATES]


def frontier(results) -> dict:
    """Final loss against bytes per rank, per family (seed 0; paired gaps where there are
    seeds), and at each point's bytes the setting with the lowest loss at no more bytes."""
    points = []
    for family, name in frontier_names(results):
        source = FRONTIER_ALIASES.get(name, name)
        runs = runs_of(results, source)
        f = finals(results, source)
        if 0 not in f:
            continue
        c = CANDIDATES[name]
        run0 = next(r for r in runs if r["seed"] == 0)
        points.append({"family": family, "candidate": name, "source": source,
                       "label": c.label, "lr": c.lr, "density": c.density
                       if c.optimizer in ("scape", "topk_adamw") else None,
                       "payload": c.payload if c.optimizer == "scape" else None,
                       "sent_bytes": run0["sent_bytes"], "seed0": f[0],
                       **dict(zip(("steady_step_bytes", "steady_source"),
                                  steady_step_bytes(run0, results))),
                       **gap_fields(*gaps_to_baseline(results, source))})
    mark_best_within(points)
    return {"points": points}


def mark_best_within(points: list[dict]) -> None:
    """Give each point (``candidate``, ``seed0`` loss, ``sent_bytes``, ``steady_step_bytes``)
    the candidate with the lowest loss among the points that send no more bytes: in total
    (``best_within``) and per steady step (``best_within_per_step``, where known)."""
    for pt in points:
        cheaper = [q for q in points if q["sent_bytes"] <= pt["sent_bytes"]]
        pt["best_within"] = min(cheaper, key=lambda q: q["seed0"])["candidate"]
        if pt["steady_step_bytes"] is not None:
            cheaper = [q for q in points if q["steady_step_bytes"] is not None
                       and q["steady_step_bytes"] <= pt["steady_step_bytes"]]
            pt["best_within_per_step"] = min(cheaper, key=lambda q: q["seed0"])["candidate"]


def best_cell(pt: dict, key: str) -> str:
    """A table cell naming the point's ``best_within*`` setting (``mark_best_within``)."""
    b = pt.get(key)
    return "n/a" if b is None else ("**this**" if b == pt["candidate"] else f"`{b}`")


def paired_sd_range(front: dict) -> tuple[float, float] | None:
    """The smallest and largest sd of the paired gaps (2+ seeds) on the frontier."""
    sds = [p["paired"]["sd"] for p in front["points"] if p["paired"] and p["paired"].get("sd")]
    return (min(sds), max(sds)) if sds else None


def render_frontier(front: dict, fig_rel: str) -> str:
    def g(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    sds = paired_sd_range(front)
    spread = ("" if sds is None else
              f" (the paired gaps' sd over seeds is {sds[0]:.4f}-{sds[1]:.4f} on this frontier)")
    lines = [F_BEGIN, "", "## The quality-per-byte frontier", "",
             f"Final validation loss after {STEPS} steps against the data bytes a rank sent: over "
             "the whole run (total) and per step once the density schedule has settled (steady: "
             "after the warm-up, before a cooldown), on the study's setup (seed 0; `paired` where "
             "3 seeds ran). SCAPE's no-warm-up points run at lr 2e-3 for d >= 0.05 and 4e-3 below "
             "(the screens' best); dense, top-k and PowerSGD at their best lr of the convergence study; every other "
             "setting the search ran is on it too. 'Best at these bytes' is the lowest seed-0 loss "
             "among the points that send no more, in total and per steady step. When the network "
             "bounds every step, the per-step bytes set the wall clock; when it does not, the "
             "total does. A seed-0 difference below about twice a paired gap's sd is within the "
             f"seed-to-seed spread{spread}.", "",
             "| family | setting | lr | MB sent per rank | KB per steady step | final val loss | "
             "gap to AdamS | paired gap [95% CI] | best at these bytes | best at these bytes "
             "per step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for pt in sorted(front["points"], key=lambda q: q["sent_bytes"]):
        step = pt.get("steady_step_bytes")
        lines.append(f"| {pt['family']} | {pt['label']} (`{pt['candidate']}`) | {pt['lr']:g} | "
                     f"{pt['sent_bytes'] / 1e6:,.1f} | "
                     f"{g(None if step is None else step / 1e3, ',.1f')} | {pt['seed0']:.4f} | "
                     f"{gap_cell(pt)} | {paired_cell(pt['paired'])} | "
                     f"{best_cell(pt, 'best_within')} | {best_cell(pt, 'best_within_per_step')} |")
    lines += ["", f"![final loss against bytes, total and per step]({fig_rel}/frontier.png)", "",
              f"The runs: `{fig_rel}/scape99_search.json` (its `frontier` key holds this table). "
              "Regenerate with `.venv/bin/python scripts/study_scape99.py --report-only`.", "",
              F_END]
    return "\n".join(lines) + "\n"


def plot_frontier(front: dict, path: Path) -> None:
    def tag(q: dict) -> tuple[str, bool]:    # the no-warm-up SCAPE families: a line over d
        series = q["family"].startswith("SCAPE ") and "no warm-up" in q["family"]
        return (f"d {q['density']:g}" if series else q["candidate"]), series

    plot_bytes_views([{**q, "tag": tag(q)} for q in front["points"]],
                     [f for f, _ in FAMILIES] + [OTHER_SETTINGS],
                     f"Quality per byte, {STEPS} steps, 4 ranks", path)


def plot_bytes_views(points: list[dict], families: list[str], title: str, path: Path) -> None:
    """Final loss (``seed0``) against the bytes a rank sent, over the run (left) and per steady
    step (right), log x; one series per family in ``families`` order, each point annotated
    with ``tag`` = (text, joined by a line with its family's other points)."""
    fig, axes = _axes((13, 5), ncols=2)
    for ax, key, scale, unit in ((axes[0], "sent_bytes", 1e6, "MB sent per rank over the run"),
                                 (axes[1], "steady_step_bytes", 1e3,
                                  "KB sent per rank per steady step")):
        for family in families:
            pts = sorted((q for q in points if q["family"] == family
                          and q.get(key) is not None), key=lambda q: q[key])
            if not pts:
                continue
            xs, ys = [q[key] / scale for q in pts], [q["seed0"] for q in pts]
            ax.plot(xs, ys, "o-" if pts[0]["tag"][1] else "s", ms=5, label=family)
            for q, x, y in zip(pts, xs, ys):
                ax.annotate(q["tag"][0], (x, y), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_xscale("log")
        ax.set(xlabel=f"{unit} (log)", ylabel="final validation loss (seed 0)", title=title)
    sq._save_figure(fig, [axes[0]], path)


def scale_check(results) -> dict:
    """Seed 0 of each candidate run on a larger model than the search's, per model shape, with
    its gap to dense AdamS on the same shape and seed (paired only at one commit)."""
    shapes = {}
    for r in sorted(results.values(), key=lambda r: r["id"]):
        shapes.setdefault(r["shape"], []).append(r)
    out = []
    for shape, runs in shapes.items():
        base = [r for r in runs if r["candidate"] == BASELINE]
        for r in runs:
            g = None if r["candidate"] == BASELINE else _paired(
                [r], base, f"{r['id']} vs {BASELINE}", seeds=[r["seed"]])
            out.append({"shape": shape, "candidate": r["candidate"], "label": r["label"],
                        "lr": r["lr"], "seed": r["seed"], "steps": r["steps"],
                        "final_val_loss": r["final_val_loss"], "sent_bytes": r["sent_bytes"],
                        **{k.replace("_seed0", ""): v for k, v in gap_fields(g, None).items()
                           if k != "paired"},
                        "wall_s": r["wall_s"], "val_loss": r["val_loss"]})
    return {"rows": out}


def render_scale(scale: dict, fig_rel: str) -> str:
    lines = [S_BEGIN, "", "## At a larger scale", "",
             "Seed 0, each candidate at the lr in its row, on a model larger than the "
             "search's (`study_quality.SHAPES`; the same data, tokens per step, vocabulary and "
             "lr schedule). Gaps are to dense AdamS on the same model.", "",
             "| model | candidate | lr | steps | final val loss | gap to AdamS | MB sent per rank "
             "| wall time (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in scale["rows"]:
        loss = "diverged" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}"
        gap = REFUSED if r.get("gap_refused") else (
            "" if r["gap"] is None or r["candidate"] == BASELINE else f"{r['gap']:+.4f}")
        mb = "n/a" if r["sent_bytes"] is None else f"{r['sent_bytes'] / 1e6:,.1f}"
        lines.append(f"| `{r['shape']}` | {r['label']} (`{r['candidate']}`) | {r['lr']:g} | "
                     f"{r['steps']} | {loss} | {gap} | {mb} | {r['wall_s']:.0f} |")
    lines += ["", f"![validation loss at scale]({fig_rel}/scape99_scale.png)", "",
              "Run: `.venv/bin/python scripts/study_scape99.py --shape study_x5 --screen adams "
              "scape99 s99_fp8_d10_now` (runs in `scape99_search.json`, `scale` key).", "", S_END]
    return "\n".join(lines) + "\n"


def plot_scale(scale: dict, path: Path) -> None:
    fig, ax = _axes((7.5, 4.5))
    for r in scale["rows"]:
        if r["val_loss"]:
            xs, ys = zip(*r["val_loss"])
            ax.plot(xs, ys, "o-", ms=3, label=f"{r['label']}, lr {r['lr']:g} ({r['shape']})")
    ax.set(xlabel="step", ylabel="validation loss (seed 0)", title="At a larger scale")
    ax.set_ylim(top=min(ax.get_ylim()[1], 7.0))
    ax.legend(fontsize=7)
    sq._save_figure(fig, [ax], path)


def write_outputs(results, json_path: Path, report: Path) -> None:
    for r in results.values():
        r.setdefault("shape", SHAPE)
    search = {k: r for k, r in results.items() if r["shape"] == SHAPE}
    scale = scale_check({k: r for k, r in results.items() if r["shape"] != SHAPE})
    summary = summarize(search)
    front = frontier(search)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    sq.write_atomic(json_path, json.dumps({"steps": STEPS, "budget": BUDGET, "summary": summary,
                                           "frontier": front, "scale": scale,
                                           "runs": sorted(results.values(), key=lambda r: r["id"])},
                                          indent=1))
    if summary["rows"]:
        plot(summary, json_path.parent / "scape99_search.png")
    rel = os.path.relpath(json_path.parent, report.parent)
    def _replace_section(text: str, name: str, section: str) -> str:
        return doc_sections.replace_section(text, name, section, str(report), append=True)

    text = _replace_section(report.read_text(), "study_scape99", render(summary, rel))
    if front["points"]:
        plot_frontier(front, json_path.parent / "frontier.png")
        text = _replace_section(text, "study_frontier", render_frontier(front, rel))
    if scale["rows"]:
        plot_scale(scale, json_path.parent / "scape99_scale.png")
        text = _replace_section(text, "study_scale", render_scale(scale, rel))
    sq.write_atomic(report, text)


def load(runs_dir: Path) -> dict[str, dict]:
    return {r["id"]: r for r in (json.loads(f.read_text())
                                 for f in sorted(runs_dir.glob("*/result.json")))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--screen", nargs="*", default=[], choices=list(CANDIDATES))
    p.add_argument("--confirm", nargs="*", default=[], choices=list(CANDIDATES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--shape", choices=list(sq.SHAPES), default=SHAPE,
                   help="the model; another than the search's is a scale check")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--out-dir", default=str(REPO / "outputs" / "study_scape99"))
    p.add_argument("--json", default=str(REPO / "docs" / "figures" / "scape99_search.json"))
    p.add_argument("--report", default=str(REPO / "docs" / "quality.md"))
    p.add_argument("--extra", nargs="*", default=["trainer.dist_timeout_s=3600"])
    p.add_argument("--unrecorded-commit", default=None,
                   help="the commit that the JSON's runs without a recorded commit ran at")
    a = p.parse_args(argv)
    runs_dir = Path(a.out_dir) / "runs"
    # the JSON's runs (a report renders from it alone), the run directories' over them
    results = {**sq.json_runs(Path(a.json), a.unrecorded_commit),
               **(load(runs_dir) if runs_dir.exists() else {})}
    todo = [(CANDIDATES[n], 0) for n in a.screen]
    confirm = list(dict.fromkeys([BASELINE, *a.confirm])) if a.confirm else []
    todo += [(CANDIDATES[n], k) for k in range(a.seeds) for n in confirm]
    todo = [(c, k) for c, k in todo if run_id(c, k, a.steps, a.shape) not in results]
    for c, k in todo:
        print(f"planned: {run_id(c, k, a.steps, a.shape)}  {' '.join(c.overrides(a.steps))}")
    if a.dry_run:
        return 0
    lock = sq.study_lock(runs_dir, "study_scape99.py")
    if lock is None:
        return 1
    with lock:
        for c, k in ([] if a.report_only else todo):
            r = execute(c, k, a.steps, a.ranks, runs_dir, a.extra, a.shape)
            results[r["id"]] = r
            write_outputs(results, Path(a.json), Path(a.report))
        write_outputs(results, Path(a.json), Path(a.report))
    return 0


if __name__ == "__main__":
    sq.cli(main)
