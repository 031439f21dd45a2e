#!/usr/bin/env python3
"""The horizon study: does SCAPE-99's gap to dense AdamS close with the tokens per parameter?

The search's setup (``study_scape99.py``: the ``study`` model on ``data=classics``, 4 gloo ranks,
1024 tokens per step, seeds 1000+k, lr warm-up 10% then cosine to lr/10 ending at each run's own
length), run at several horizons:

1. ``tune``: every setting (dense AdamS included) and the local-step candidates at
   ``--tune-steps`` (10000), seed 0, at 3 lrs (its search lr x 0.5, 1, 2), the grid extended
   one step past an edge where the winner sits (``--max-extensions``, 4, per side); the lowest final
   validation loss wins and is used at every horizon;
2. ``horizons``: the settings at every horizon (3000, 10000, 30000 steps), 3 paired seeds for
   dense AdamS and SCAPE-99, seed 0 for the others.

Every run checkpoints every ``--checkpoint-every`` steps (1000) and resumes from its last
checkpoint when the study is started again (``resume=auto``); finished runs are skipped, so a
killed study loses at most that many steps per run. SIGTERM to the study (or to ``--drive``)
loses none: it is passed on to the run's trainer, which checkpoints and exits, and the stopped
segment's time counts in the run's recorded wall time (a checkout driven with ``--drive`` does
so only where its own tool has this rule; 496b96f's does not: send its trainer SIGTERM too, or
the trainer trains on without the tool). Each run records the commit of the code
it ran (``code.json`` at its start; a resume at another commit is refused) and its command.

The runs write JSON only (``docs/figures/scape99_horizons.json``); ``--report-only`` computes the
summary again from that JSON's runs (under the command line's plan), then renders the section of
``docs/quality.md`` and the figure from it.

    .venv/bin/python scripts/study_horizons.py --dry-run                 # plan and estimate
    .venv/bin/python scripts/study_horizons.py --stage tune              # the lr tuning
    .venv/bin/python scripts/study_horizons.py --stage horizons          # then the horizons
    .venv/bin/python scripts/study_horizons.py --report-only

Long runs go in a checkout at a fixed commit (``git worktree add ../runs 496b96f``; a resume at
another commit is refused). ``--drive ../runs`` plans with this tool's rules and has that
checkout's tool run each ready run; copy its JSON here and ``--report-only`` to render. The
local-step candidates ran in a second checkout (2736b3d: their last round ends at the run's last
step); ``--report-only --runs-from ../runs_local/docs/figures/scape99_horizons.json`` merges its
runs. They sit on the bytes views only, never in a paired gap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_sections  # noqa: E402
import study_quality as sq  # noqa: E402
import study_scape99 as s99  # noqa: E402

REPO = sq.REPO
H_BEGIN, H_END = doc_sections.markers("study_horizons")
HORIZONS = (3000, 10000, 30000)
TUNE_STEPS = 10000
LR_FACTORS = (0.5, 1.0, 2.0)
# lrs added beyond each edge of the grid while the winner sits there: 2 left DiLoCo's and GASLoC's
# winners at their lowest lr, where the outer Nesterov step (0.7, 0.9: about 7x an inner step's
# drift once its momentum builds) wants inner lrs below dense training's
MAX_EXTENSIONS = 4
CHECKPOINT_EVERY = 1000
MARGIN = s99.MARGIN
BASELINE = s99.BASELINE
GAP_SETTING = "scape99"          # the setting whose gap is fitted against tokens per parameter


@dataclass(frozen=True)
class Setting:
    candidate: str               # a study_scape99 candidate (its lr: the grid's centre)
    seeds: int                   # seeds at every horizon
    horizons: bool = True        # False: a candidate at the tuning horizon only


SETTINGS = {s.candidate: s for s in [
    Setting("adams", 3),
    Setting("scape99", 3),                # the paper's schedule: geometric warm-up over 10%
    Setting("f_fp8_e4m3_d01", 1),         # SCAPE-99's steady bytes per step, 4x cheaper values
    Setting("f_fp8_e4m3_d10", 1),         # the recommended setting
    # local-step training at the tuning horizon, on the bytes frontier
    Setting("diloco_h30", 1, horizons=False), Setting("diloco_h10", 1, horizons=False),
    Setting("gasloc_h30", 1, horizons=False), Setting("gasloc_h10", 1, horizons=False),
    Setting("sparseloco_h10", 1, horizons=False), Setting("sparseloco_h30", 1, horizons=False),
    Setting("sparseloco_h10_fp8", 1, horizons=False),
    Setting("sparseloco_h10_fp4", 1, horizons=False),
    Setting("streaming_h30_f3", 1, horizons=False),
    Setting("streaming_h30_f3_fp4", 1, horizons=False),
    Setting("streaming_h30_f3_fp4_ef", 1, horizons=False),
]}


@dataclass
class Plan:
    shape: str = s99.SHAPE
    ranks: int = 4
    horizons: tuple[int, ...] = HORIZONS
    tune_steps: int = TUNE_STEPS
    lr_factors: tuple[float, ...] = LR_FACTORS
    settings: tuple[str, ...] = tuple(SETTINGS)
    seeds: int | None = None     # None: each setting's own; else at most this many
    max_extensions: int = MAX_EXTENSIONS


@dataclass(frozen=True)
class HRun:
    setting: str
    lr: float
    seed: int
    steps: int
    stage: str

    @property
    def candidate(self) -> s99.Candidate:
        return dataclasses.replace(s99.CANDIDATES[self.setting], lr=self.lr)

    def id(self, shape: str) -> str:
        return s99.run_id(self.candidate, self.seed, self.steps, shape)


# ------------------------------------------------------------------------------ the plan


def lr_grid(setting: str, factors) -> list[float]:
    centre = s99.CANDIDATES[setting].lr
    return [float(f"{centre * f:.3g}") for f in factors]


def _tune_losses(results: dict, setting: str, p: Plan) -> dict[float, float | None]:
    """Every finished seed-0 tuning run of ``setting``: lr -> final validation loss (None:
    diverged)."""
    return {r["lr"]: r["final_val_loss"] for r in results.values()
            if r["candidate"] == setting and r["seed"] == 0 and r["steps"] == p.tune_steps}


def _has(lrs, lr: float) -> bool:
    return any(math.isclose(lr, x) for x in lrs)


def tuning(results: dict, setting: str, p: Plan) -> tuple[list[float], float | None, bool]:
    """The setting's lr grid as the runs so far make it, its winner, and whether the winner sits
    at the grid's edge.

    The grid starts at ``p.lr_factors`` of the search lr. Once every lr of it has finished, a
    winner at the lowest (highest) lr adds the next lr below (above) it, one grid ratio further,
    at most ``p.max_extensions`` times per side, so a winner is only taken where both neighbours
    lost (or the extensions ran out: ``at_edge``). The winner is None until every lr of the
    grid has finished, or if all diverged."""
    done = _tune_losses(results, setting, p)
    factors = sorted(p.lr_factors)
    ratio = factors[1] / factors[0] if len(factors) > 1 else 2.0
    extended = {"low": 0, "high": 0}
    while True:
        grid = lr_grid(setting, factors)
        if not all(_has(done, lr) for lr in grid):
            return grid, None, False
        ok = {lr: v for lr, v in done.items() if v is not None and _has(grid, lr)}
        if not ok:
            return grid, None, False
        best = min(ok, key=ok.get)
        side = ("low" if math.isclose(best, min(grid)) else
                "high" if math.isclose(best, max(grid)) else None)
        if side is None or len(grid) < 2:
            return grid, best, False
        if extended[side] == p.max_extensions:
            return grid, best, True
        extended[side] += 1
        factors = ([factors[0] / ratio, *factors] if side == "low" else
                   [*factors, factors[-1] * ratio])


def tuned_lr(results: dict, setting: str, p: Plan) -> float | None:
    """The winner of the setting's lr grid (``tuning``)."""
    return tuning(results, setting, p)[1]


def plan(results: dict, p: Plan) -> list[tuple[HRun, bool]]:
    """Every run as (run, ready): a horizon run waits for its setting's tuning (planned at the
    grid's centre lr for the estimate)."""
    out, seen = [], set()

    def add(run: HRun, ready: bool) -> None:
        if run.id(p.shape) not in seen:
            seen.add(run.id(p.shape))
            out.append((run, ready))

    for name in p.settings:
        for lr in tuning(results, name, p)[0]:
            add(HRun(name, lr, 0, p.tune_steps, "tune"), True)
    # horizon by horizon (the shortest first), every setting at each: paired gaps come early
    for steps in p.horizons:
        for name in p.settings:
            st = SETTINGS[name]
            if not st.horizons:
                continue
            lr = tuned_lr(results, name, p)
            seeds = st.seeds if p.seeds is None else min(st.seeds, p.seeds)
            for seed in range(seeds):
                add(HRun(name, lr or s99.CANDIDATES[name].lr, seed, steps, "horizons"),
                    lr is not None)
    return out


# Seconds a run costs on the 2-core machine, 4 ranks, nothing else running: a 3000-step dense
# AdamS run of the study took 335 s (0.11 s per step once started), SCAPE ~3% more per step.
# Each run's start and end (5 processes importing torch on 2 cores, the DDP start-up check, the
# final checkpoint and loss plot) took 45-55 s with other work loading the machine (load 10-14),
# where a step took 0.14-0.19 s. A DiLoCo run (H = 30) makes no per-step collective: 10020
# steps took 490 s in all, about 0.045 s per step, beside light other work (2026-12-05); GASLoC's
# runs took as long.
STEP_S = {"dense": 0.11, "scape": 0.115, "diloco": 0.045, "gasloc": 0.045, "sparseloco": 0.045}
STARTUP_S = 50.0


FAMILIES = {"dense": "dense AdamS", "scape": "SCAPE", "diloco": "DiLoCo", "gasloc": "GASLoC",
            "sparseloco": "SparseLoCo"}


def family_key(setting: str) -> str:
    """dense, scape, or the setting's local-step strategy (diloco, gasloc, sparseloco)."""
    c = s99.CANDIDATES[setting]
    return c.strategy if c.strategy != "data_parallel" else (
        "scape" if c.optimizer == "scape" else "dense")


def family(setting: str) -> str:
    """The setting's family on the bytes views."""
    return FAMILIES[family_key(setting)]


def estimate_s(run: HRun) -> float:
    checkpoints = run.steps // CHECKPOINT_EVERY
    return STARTUP_S + run.steps * STEP_S[family_key(run.setting)] + 0.5 * checkpoints


# ------------------------------------------------------------------------------ the report


def study_params(shape: str) -> int:
    """Parameters of the study's model (the trainer's count, built on the meta device)."""
    from hydra import compose, initialize_config_dir

    from scape_train.config import register_configs, to_object
    from scape_train.models.build import build_model

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = to_object(compose(config_name="config",
                                overrides=[*sq.SHAPES[shape], "data=classics"]))
    model = build_model(cfg.model, vocab_size=cfg.data.tokenizer.vocab_size, device="meta")
    return model.num_params()


def tokens_per_step(shape: str, ranks: int) -> int:
    over = dict(o.split("=", 1) for o in sq.SHAPES[shape])
    return ranks * int(over["trainer.micro_batch_size"]) * int(over["data.seq_len"])


def power_law(points: list[dict], margin: float = MARGIN) -> dict:
    """A weighted least-squares fit of ``log gap = log a - b·log x`` (x: tokens per parameter)
    to points ``{"x", "mean", "se"}`` (weights 1/var of log gap, var = (se/gap)^2), with b's 95%
    interval (its standard error from the weights alone), and the x where the fitted gap
    reaches ``margin`` (with the range b's interval gives it, the fit pivoting at the weighted
    mean of log x). ``{"ok": False, "why": ...}`` where no trend can be read."""
    if len(points) < 3:
        return {"ok": False, "why": f"{len(points)} horizon(s) with a paired interval: a trend "
                "needs 3 or more"}
    bad = [pt for pt in points if pt["mean"] <= 0]
    if bad:
        return {"ok": False, "why": "the gap is not positive at "
                + ", ".join(f"{pt['x']:.3g} tokens/param" for pt in bad)
                + " (a power law of a positive gap does not hold)"}
    if any(not pt["se"] or pt["se"] <= 0 for pt in points):
        return {"ok": False, "why": "a horizon's gap has no spread over seeds (no weight)"}
    lx = [math.log(pt["x"]) for pt in points]
    ly = [math.log(pt["mean"]) for pt in points]
    w = [(pt["mean"] / pt["se"]) ** 2 for pt in points]
    sw = sum(w)
    xbar = sum(wi * x for wi, x in zip(w, lx)) / sw
    ybar = sum(wi * y for wi, y in zip(w, ly)) / sw
    sxx = sum(wi * (x - xbar) ** 2 for wi, x in zip(w, lx))
    slope = sum(wi * (x - xbar) * (y - ybar) for wi, x, y in zip(w, lx, ly)) / sxx
    b, se_b = -slope, 1 / math.sqrt(sxx)
    lo, hi = b - 1.96 * se_b, b + 1.96 * se_b
    log_a = ybar - slope * xbar

    def reach(bb: float) -> float | None:   # gap(x) = exp(ybar - bb (log x - xbar)) = margin
        return None if bb <= 0 else math.exp(xbar + (ybar - math.log(margin)) / bb)
    fitted = [math.exp(log_a + slope * x) for x in lx]
    chi2 = sum(wi * (y - math.log(f)) ** 2 for wi, y, f in zip(w, ly, fitted))
    out = {"ok": True, "a": math.exp(log_a), "b": b, "b_lo": lo, "b_hi": hi, "se_b": se_b,
           "x_margin": reach(b), "x_margin_range": [reach(hi), reach(lo)],
           "fitted": [{"x": pt["x"], "mean": pt["mean"], "fit": f}
                      for pt, f in zip(points, fitted)],
           "chi2": chi2, "dof": len(points) - 2}
    if b <= 0:
        out["why"] = "the fitted gap does not shrink with the horizon (b <= 0)"
    return out


def horizon_summary(results: dict, params: int, step_tokens: int, p: Plan) -> dict:
    """From the runs alone: the tuning (every lr's seed-0 loss, the winner, whether it sits at
    the grid's edge), each setting's gap to dense AdamS per horizon (paired over seeds where
    there are several, seed 0 otherwise) at its tokens per parameter, the power-law fit of
    SCAPE-99's gap, and the tuning horizon's settings and local-step candidates on both bytes
    views (total; steady per step)."""
    tune = {}
    for name in p.settings:
        grid, best, at_edge = tuning(results, name, p)
        pts = sorted([lr, v] for lr, v in _tune_losses(results, name, p).items()
                     if _has(grid, lr))
        finished = [(v, lr) for lr, v in pts if v is not None]
        tune[name] = {"label": s99.CANDIDATES[name].label, "grid": grid, "losses": pts,
                      "best": best, "at_edge": at_edge,
                      # while the grid waits for runs: its best finished lr (the bytes views)
                      "so_far": min(finished)[1] if best is None and finished else None}
    gaps = {}
    for name in p.settings:
        lr, base_lr = tune[name]["best"], tune.get(BASELINE, {}).get("best")
        # local-step candidates are on the bytes views only (they may run at another commit)
        if name == BASELINE or lr is None or base_lr is None or not SETTINGS[name].horizons:
            continue
        per = {}
        for steps in sorted({r["steps"] for r in results.values()}):
            mine = [r for r in results.values() if r["candidate"] == name and r["steps"] == steps
                    and math.isclose(r["lr"], lr)]
            base = [r for r in results.values() if r["candidate"] == BASELINE
                    and r["steps"] == steps and math.isclose(r["lr"], base_lr)]
            g = sq.paired(mine, base, f"{name} vs {BASELINE} at {steps} steps")
            if g:
                per[str(steps)] = {**g, "steps": steps,
                                   "tokens_per_param": steps * step_tokens / params}
        gaps[name] = per
    fit_points = [{"x": g["tokens_per_param"], "mean": g["mean"],
                   "se": g["sd"] / math.sqrt(g["n"]) if g["sd"] else None}
                  for g in gaps.get(GAP_SETTING, {}).values() if g["n"] >= 2]
    fit = power_law(fit_points)
    if fit.get("x_margin"):
        fit["steps_margin"] = fit["x_margin"] * params / step_tokens
        fit["steps_margin_range"] = [None if x is None else x * params / step_tokens
                                     for x in fit["x_margin_range"]]
    front = []
    for name in p.settings:
        lr = tune[name]["best"] if tune[name]["best"] is not None else tune[name]["so_far"]
        run = next((r for r in results.values() if lr is not None and r["candidate"] == name
                    and r["seed"] == 0 and r["steps"] == p.tune_steps
                    and math.isclose(r["lr"], lr)), None)
        if run is None or run["final_val_loss"] is None:
            continue
        step_bytes, source = s99.steady_step_bytes(run, results)
        front.append({"candidate": name, "label": tune[name]["label"], "family": family(name),
                      "lr": lr, "seed0": run["final_val_loss"], "sent_bytes": run["sent_bytes"],
                      "steady_step_bytes": step_bytes, "steady_source": source,
                      "commit": run.get("commit"), "so_far": tune[name]["best"] is None})
    s99.mark_best_within(front)
    held_out = {}
    for name in (BASELINE, GAP_SETTING):
        lr = tune.get(name, {}).get("best")
        for r in results.values():
            if (lr is not None and r["candidate"] == name and math.isclose(r["lr"], lr)
                    and r["final_val_loss"] is not None):
                g = held_out_gap(r)
                if g is not None:
                    held_out.setdefault(str(r["steps"]), {}).setdefault(
                        str(r["seed"]), {})[name] = {**g, "val": r["final_val_loss"]}
    return {"params": params, "tokens_per_step": step_tokens, "tune_steps": p.tune_steps,
            "max_extensions": p.max_extensions,
            "horizons": list(p.horizons), "margin": MARGIN, "tune": tune, "gaps": gaps,
            "fit": fit, "frontier": front, "held_out": held_out}


def held_out_gap(run: dict, tail: float = 0.2) -> dict | None:
    """The final validation loss minus the mean training loss logged over the run's last
    ``tail`` of steps, with that mean's standard error: near 0 while the model generalizes,
    growing once it fits the repeated text (the long horizons make several passes)."""
    tail_losses = [v for step, v in run.get("train_loss") or []
                   if step > (1 - tail) * run["steps"]]
    if len(tail_losses) < 2:
        return None
    mean = statistics.fmean(tail_losses)
    return {"gap": run["final_val_loss"] - mean, "train": mean,
            "se": statistics.stdev(tail_losses) / math.sqrt(len(tail_losses)),
            "logs": len(tail_losses)}


def _num(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def render_horizons(summary: dict, fig_rel: str) -> str:
    """The section of ``docs/quality.md``: markdown from :func:`horizon_summary` alone."""
    s = summary
    lines = [H_BEGIN, "", "## The gap against tokens per parameter", "",
             f"The search's setup ({s['params']:,} parameters, {s['tokens_per_step']:,} tokens per "
             f"step) at {', '.join(f'{h:,}' for h in s['horizons'])} steps, each run's lr schedule "
             f"ending at its own length. lr tuned at {s['tune_steps']:,} steps on seed 0 (3 values "
             "per setting, one more past an edge where the winner sits, at most "
             f"{s.get('max_extensions', 2)} per side), "   # a summary written before the option: 2
             "the winner used at every horizon. Gaps are to dense AdamS on the same "
             "seed: the mean over paired seeds with its 95% t-interval, or seed 0's alone.", "",
             "| setting | lr: final val loss (seed 0) | winner |", "|---|---|---|"]
    for name, t in s["tune"].items():
        pts = ", ".join(f"{lr:g}: " + ("diverged" if v is None else f"{v:.4f}")
                        for lr, v in t["losses"]) or "not run"
        missing = [lr for lr in t["grid"] if not any(math.isclose(lr, x) for x, _ in t["losses"])]
        win = ("waits for " + ", ".join(f"{lr:g}" for lr in missing)
               if t["best"] is None and t["losses"] and missing else
               "n/a" if t["best"] is None else f"{t['best']:g}" + (
                   " (at the grid's edge after its extensions)" if t["at_edge"] else ""))
        lines.append(f"| {t['label']} (`{name}`) | {pts} | {win} |")
    lines += ["", "| setting | steps | tokens per parameter | seeds | gap to AdamS | 95% interval "
              "| per seed |", "|---|---|---|---|---|---|---|"]
    for name, per in s["gaps"].items():
        for g in sorted(per.values(), key=lambda g: g["steps"]):
            ci = "n/a" if g["lo"] is None else f"[{g['lo']:+.4f}, {g['hi']:+.4f}]"
            seeds = ", ".join(f"{k}: {d:+.4f}" for k, d in zip(g["seeds"], g["diffs"]))
            lines.append(f"| {s['tune'][name]['label']} (`{name}`) | {g['steps']:,} | "
                         f"{g['tokens_per_param']:.1f} | {g['n']} | {g['mean']:+.4f} | {ci} "
                         f"| {seeds} |")
    f = s["fit"]
    if f["ok"]:
        rng = f.get("steps_margin_range") or [None, None]
        reach = ("the fitted gap does not shrink" if f.get("x_margin") is None else
                 f"{f['x_margin']:.0f} tokens per parameter, {f['steps_margin']:,.0f} steps of "
                 f"this study (b's interval: {_num(rng[0], ',.0f')} to {_num(rng[1], ',.0f')} "
                 "steps)")
        lines += ["", f"SCAPE-99's gap fitted as gap = a·(tokens/param)^(-b), weighted by its "
                  f"intervals: a = {f['a']:.3g}, b = {f['b']:.3f} [{f['b_lo']:.3f}, "
                  f"{f['b_hi']:.3f}]. It reaches {s['margin']} at {reach}."]
        pairs = "; ".join(f"{pt['mean']:+.3f} against {pt['fit']:+.3f} at {pt['x']:.1f}"
                          for pt in f["fitted"])
        lines += ["", f"Measured gap against the fitted one, by tokens per parameter: {pairs}. "
                  f"The weighted squared residuals (log gap) sum to {f['chi2']:.2f} on "
                  f"{f['dof']} degree(s) of freedom: about {f['dof']} where the law holds and "
                  "the intervals are right, much more where it does not."]
    else:
        lines += ["", f"No power law is fitted to SCAPE-99's gap: {f['why']}."]
    held = s.get("held_out", {})
    if held:
        names = [n for n in (BASELINE, GAP_SETTING) if n in s["tune"]]
        lines += ["", "Validation minus training loss at the end of each run at the tuned lr (the "
                  "training loss averaged over the logs of the run's last 20% of steps, ± its "
                  "standard error): near 0 while the model generalizes, growing once it fits the "
                  "repeated text; and SCAPE-99's gap to dense AdamS of the same seed on that "
                  "training loss beside its gap on validation loss, with their means over the "
                  "seeds that have both.", "",
                  "| steps | seed | " + " | ".join(f"{s['tune'][n]['label']}: validation - "
                                                  "training" for n in names)
                  + " | gap on training loss | gap on validation loss |",
                  "|---|---|" + "---|" * (len(names) + 2)]
        for steps in sorted(held, key=int):
            paired = []
            for seed in sorted(held[steps], key=int):
                h = held[steps][seed]
                cells = [f"{h[n]['gap']:+.3f} ± {h[n]['se']:.3f}" if n in h else "n/a"
                         for n in names]
                gaps = "n/a | n/a"
                if BASELINE in h and GAP_SETTING in h:
                    a, b = h[BASELINE], h[GAP_SETTING]
                    paired.append((b["train"] - a["train"], b["val"] - a["val"]))
                    gaps = (f"{paired[-1][0]:+.3f} ± {math.hypot(a['se'], b['se']):.3f} | "
                            f"{paired[-1][1]:+.3f}")
                lines.append(f"| {int(steps):,} | {seed} | " + " | ".join(cells) + f" | {gaps} |")
            if len(paired) > 1:
                mean_train, mean_val = (statistics.fmean(col) for col in zip(*paired))
                lines.append(f"| {int(steps):,} | mean of {len(paired)} | "
                             + " | ".join("" for _ in names)
                             + f" | {mean_train:+.3f} | {mean_val:+.3f} |")
    if s["frontier"]:
        lines += ["", f"At {s['tune_steps']:,} steps (seed 0, tuned lr), loss against the bytes "
                  "a rank sent, in total and per steady step (after the density warm-up; a "
                  "local-step method's is its exchange averaged over its H steps). 'Best at "
                  "these bytes' is the lowest loss among the settings that send no more, in total "
                  "and per steady step. Each run's code commit is in the last column: points "
                  "of different commits are set side by side here, never paired:", "",
                  "| setting | lr | final val loss | MB sent per rank | KB per steady step | "
                  "best at these bytes | best at these bytes per step | commit |",
                  "|---|---|---|---|---|---|---|---|"]
        for pt in sorted(s["frontier"], key=lambda q: q["sent_bytes"] or 0):
            so_far = " (best so far: its grid waits)" if pt.get("so_far") else ""
            lines.append(f"| {pt['label']} (`{pt['candidate']}`) | {pt['lr']:g}{so_far} | "
                         f"{pt['seed0']:.4f} | "
                         f"{_num(pt['sent_bytes'] and pt['sent_bytes'] / 1e6, ',.1f')} | "
                         f"{_num(pt['steady_step_bytes'] and pt['steady_step_bytes'] / 1e3, ',.1f')}"
                         f" | {s99.best_cell(pt, 'best_within')} | "
                         f"{s99.best_cell(pt, 'best_within_per_step')} | "
                         f"{(pt.get('commit') or 'n/a')[:7]} |")
        lines += ["", f"![loss against bytes at {s['tune_steps']:,} steps, total and per step]"
                  f"({fig_rel}/scape99_horizons_bytes.png)"]
    lines += ["", f"![gap against tokens per parameter]({fig_rel}/scape99_horizons.png)", "",
              f"Every run with its commit and command: `{fig_rel}/scape99_horizons.json`. "
              "Regenerate: `.venv/bin/python scripts/study_horizons.py --report-only`.", "", H_END]
    return "\n".join(lines) + "\n"


def plot_horizons(summary: dict, path: Path) -> None:
    from matplotlib.ticker import FuncFormatter

    fig, ax = s99._axes((7.5, 4.5))
    for i, (name, per) in enumerate(summary["gaps"].items()):
        gs = sorted(per.values(), key=lambda g: g["steps"])
        if not gs:
            continue
        xs = [g["tokens_per_param"] * (1 + 0.03 * i) for g in gs]
        err = [[0 if g["lo"] is None else g["mean"] - g["lo"] for g in gs],
               [0 if g["hi"] is None else g["hi"] - g["mean"] for g in gs]]
        ax.errorbar(xs, [g["mean"] for g in gs], yerr=err, fmt="o-", capsize=4,
                    label=summary["tune"][name]["label"])
    f = summary["fit"]
    if f["ok"] and f["b"] > 0:
        pts = [g["tokens_per_param"] for g in summary["gaps"][GAP_SETTING].values()]
        hi = max(pts + ([f["x_margin"]] if f.get("x_margin") else []))
        xs = [min(pts) * (hi / min(pts)) ** (i / 50) for i in range(51)]
        ax.plot(xs, [f["a"] * x ** -f["b"] for x in xs], "--", lw=1,
                label=f"fit: {f['a']:.3g}·x^(-{f['b']:.2f})")
    ax.axhline(summary["margin"], ls=":", color="gray", label=f"margin {summary['margin']}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")     # 3, 10, 30 rather than 3x10^0
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.set(xlabel="tokens per parameter (log)", ylabel="final val loss gap to dense AdamS",
           title="Gap against training length, 95% t-intervals")
    sq._save_figure(fig, [ax], path)


def write_json(results: dict, p: Plan, json_path: Path, params: int) -> dict:
    summary = horizon_summary(results, params, tokens_per_step(p.shape, p.ranks), p)
    payload = {"plan": dataclasses.asdict(p), "shape_overrides": sq.SHAPES[p.shape],
               "summary": summary, "runs": sorted(results.values(), key=lambda r: r["id"])}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    sq.write_atomic(json_path, json.dumps(payload, indent=1))
    return payload


def write_report(payload: dict, json_path: Path, report: Path) -> None:
    """The section and the figure, from the JSON's summary alone."""
    summary = payload["summary"]
    plot_horizons(summary, json_path.parent / "scape99_horizons.png")
    if summary["frontier"]:
        local = {FAMILIES[k] for k in ("diloco", "gasloc", "sparseloco")}
        s99.plot_bytes_views(
            [{**pt, "tag": (f"H {s99.CANDIDATES[pt['candidate']].inner_steps}"
                            if pt["family"] in local else pt["candidate"], pt["family"] in local)}
             for pt in summary["frontier"]], list(FAMILIES.values()),
            f"Quality per byte, {summary['tune_steps']:,} steps, 4 ranks",
            json_path.parent / "scape99_horizons_bytes.png")
    rel = os.path.relpath(json_path.parent, report.parent)
    text = report.read_text() if report.exists() else "# Quality on real text\n"
    sq.write_atomic(report, doc_sections.replace_section(
        text, "study_horizons", render_horizons(payload["summary"], rel), str(report), append=True))


# ------------------------------------------------------------------------------ main


def parse(argv=None):
    a = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--stage", choices=["tune", "horizons", "all"], default="all")
    a.add_argument("--only", nargs="*", choices=list(SETTINGS), help="settings to run now")
    a.add_argument("--max-runs", type=int, default=0)
    a.add_argument("--dry-run", action="store_true")
    a.add_argument("--report-only", action="store_true")
    a.add_argument("--shape", choices=list(sq.SHAPES), default=s99.SHAPE)
    a.add_argument("--ranks", type=int, default=4)
    a.add_argument("--horizons", type=int, nargs="+", default=list(HORIZONS))
    a.add_argument("--tune-steps", type=int, default=TUNE_STEPS)
    a.add_argument("--lr-factors", type=float, nargs="+", default=list(LR_FACTORS))
    a.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    a.add_argument("--seeds", type=int, default=None, help="at most this many seeds per setting")
    a.add_argument("--max-extensions", type=int, default=MAX_EXTENSIONS,
                   help="lrs added past each edge of a grid while its winner sits there")
    a.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY)
    a.add_argument("--out-dir", default=None, help="default: outputs/study_horizons of this "
                   "checkout (of --drive's)")
    a.add_argument("--json", default=None, help="default: docs/figures/scape99_horizons.json "
                   "of this checkout (of --drive's)")
    a.add_argument("--report", default=str(REPO / "docs" / "quality.md"))
    a.add_argument("--runs-from", nargs="*", default=[], metavar="JSON",
                   help="with --report-only: the runs of these study JSONs too (another "
                   "checkout's, e.g. runs at another commit), merged into --json")
    a.add_argument("--extra", nargs="*", default=["trainer.dist_timeout_s=3600"])
    a.add_argument("--drive", metavar="WORKTREE", help="run the plan's runs with the study tool of "
                   "a checkout at the runs' commit (see drive_command); --json and --out-dir "
                   "default to that checkout's")
    return a.parse_args(argv)


def drive_command(results: dict, p: Plan, python: str) -> list[str] | None:
    """The command that has a checkout at the runs' commit (which may predate this tool's rules,
    e.g. the grid extension) run this plan's next ready run: its tool, one run, of that run's
    setting and stage, with that setting's lr grid as factors (so both tools take the same
    winner). None when no run is ready."""
    ready = [r for r, ok in plan(results, p) if ok and r.id(p.shape) not in results]
    if not ready:
        return None
    run = ready[0]
    centre = s99.CANDIDATES[run.setting].lr
    factors = sorted({float(f"{lr / centre:.6g}") for lr in tuning(results, run.setting, p)[0]})
    horizons = [str(h) for h in p.horizons]
    return [python, "scripts/study_horizons.py", "--stage", run.stage, "--settings", run.setting,
            "--max-runs", "1", "--lr-factors", *map(str, factors), "--horizons", *horizons,
            "--tune-steps", str(p.tune_steps), "--shape", p.shape, "--ranks", str(p.ranks)]


def drive(worktree: Path, p: Plan, json_path: Path, runs_dir: Path) -> int:
    """Run the plan's runs one by one in ``worktree`` (``drive_command``) until none is ready."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(worktree)}
    while True:
        results = {**sq.json_runs(json_path), **s99.load(runs_dir)} if runs_dir.exists() \
            else sq.json_runs(json_path)
        cmd = drive_command(results, p, sys.executable)
        if cmd is None:
            print("drive: no run is ready")
            return 0
        print(f"drive: {' '.join(cmd[1:])} (in {worktree})", flush=True)
        rc = sq.wait_passing_stop(subprocess.Popen(cmd, cwd=worktree, env=env), "drive")
        if rc != 0:
            return rc


def main(argv=None) -> int:
    a = parse(argv)
    root = Path(a.drive).resolve() if a.drive else REPO
    a.json = a.json or str(root / "docs" / "figures" / "scape99_horizons.json")
    a.out_dir = a.out_dir or str(root / "outputs" / "study_horizons")
    p = Plan(shape=a.shape, ranks=a.ranks, horizons=tuple(sorted(a.horizons)),
             tune_steps=a.tune_steps, lr_factors=tuple(a.lr_factors), settings=tuple(a.settings),
             seeds=a.seeds, max_extensions=a.max_extensions)
    json_path, runs_dir = Path(a.json), Path(a.out_dir) / "runs"
    results = {**sq.json_runs(json_path), **s99.load(runs_dir)} if runs_dir.exists() \
        else sq.json_runs(json_path)
    if a.drive and not (a.dry_run or a.report_only):    # those two only read the checkout's
        return drive(Path(a.drive).resolve(), p, json_path, Path(a.out_dir) / "runs")
    if a.report_only:
        if not json_path.exists():
            print(f"{json_path} does not exist: run the study first", file=sys.stderr)
            return 1
        # the summary again from the runs alone, under this plan (the JSON's own may come from
        # a narrower invocation, e.g. one setting's grid extension)
        params = json.loads(json_path.read_text())["summary"]["params"]
        runs = sq.json_runs(json_path)
        for other in a.runs_from:         # this JSON's own record of a run wins
            for rid, run in sq.json_runs(Path(other)).items():
                runs.setdefault(rid, run)
        write_report(write_json(runs, p, json_path, params), json_path, Path(a.report))
        print(f"wrote {json_path}, {a.report} and {json_path.parent / 'scape99_horizons.png'}")
        return 0
    planned = plan(results, p)

    def todo():
        return [(r, ok) for r, ok in planned if r.id(p.shape) not in results
                and (a.stage == "all" or r.stage == a.stage) and (not a.only or r.setting in a.only)]
    left = todo()
    total = sum(estimate_s(r) for r, _ in planned if r.id(p.shape) not in results)
    print(f"plan: {len(planned)} runs, {len(planned) - sum(1 for r, _ in planned if r.id(p.shape) not in results)} "
          f"finished; the rest about {total / 3600:.1f} h on this machine; this selection "
          f"{len(left)} runs, {sum(estimate_s(r) for r, _ in left) / 3600:.1f} h")
    if a.dry_run:
        for r, ok in planned:
            state = "done" if r.id(p.shape) in results else ("ready" if ok else "waits for tuning")
            print(f"  [{r.stage:8s}] {r.id(p.shape):40s} {state:17s} ~{estimate_s(r) / 60:.0f} min")
        return 0
    lock = sq.study_lock(runs_dir, "study_horizons.py")
    if lock is None:
        return 1
    params = study_params(p.shape)
    with lock:
        ran = 0
        while True:
            ready = [r for r, ok in todo() if ok]
            if not ready or (a.max_runs and ran >= a.max_runs):
                break
            run = ready[0]
            res = s99.execute(run.candidate, run.seed, run.steps, p.ranks, runs_dir, a.extra,
                              p.shape, a.checkpoint_every)
            results[res["id"]] = {**res, "stage": run.stage}
            sq.write_atomic(runs_dir / res["id"] / "result.json",
                            json.dumps(results[res["id"]], indent=1))
            ran += 1
            planned = plan(results, p)
            write_json(results, p, json_path, params)
        write_json(results, p, json_path, params)
    print(f"ran {ran} runs; wrote {json_path}")
    return 0


if __name__ == "__main__":
    sq.cli(main)
