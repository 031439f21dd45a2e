#!/usr/bin/env python3
"""The convergence study: is SCAPE as accurate as dense AdamS?

A small Llama on real text (``data=classics``), N gloo ranks on the CPU, identical tokens for
every optimizer of a seed (the seed sets the init and the data order). Every run is the real
trainer under torchrun (``python -m torch.distributed.run -m scape_train``), as in
``scripts/bench_quality.py``. Three stages, each planned from the results of the one before:

1. ``sweep``: per optimizer, a log-spaced learning-rate grid at the main horizon, seed 0; the best
   lr is the one with the lowest final validation loss (one more lr beyond the grid's edge is
   planned when the best sits at an edge);
2. ``seeds``: more seeds at each optimizer's best lr (the payload-format contenders take their
   parent SCAPE's best lr), so the SCAPE - AdamS gap gets a paired t-interval;
3. ``horizons``: the gap's optimizers at the other horizons, each run with its own schedule
   (warm-up 10%, cosine to lr/10) and SCAPE's density warm-up over the same 10% of the run.

A run's ``result.json`` is written atomically when it ends; an invocation skips finished runs,
so the study runs in pieces (``--max-runs``, ``--stage``, ``--only``). After each run it rewrites
``docs/figures/quality_study.json``, the figures and the generated section of ``docs/quality.md``.

    .venv/bin/python scripts/study_quality.py --dry-run            # the plan and its estimate
    .venv/bin/python scripts/study_quality.py                      # run what is left (2-3 h)
    .venv/bin/python scripts/study_quality.py --stage sweep --max-runs 4
    .venv/bin/python scripts/study_quality.py --report-only        # JSON, figures, doc only
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_sections  # noqa: E402

BEGIN, END = doc_sections.markers("study_quality")

# The study's model: a 2-block Llama of width 128 with a 2048-token BPE (about 0.9M parameters,
# half of them in the blocks), 4 x 64 tokens per rank per step: 1000 4-rank steps in ~2 min on 2
# cores. ``tiny`` is the test's shape.
SHAPES = {
    "study": ["model=llama_tiny", "model.n_layers=2", "model.d_model=128", "model.n_heads=4",
              "model.n_kv_heads=2", "model.ffn_dim=384", "model.max_seq_len=64",
              "data.seq_len=64", "data.tokenizer.vocab_size=2048", "data.val_tokens=8192",
              "trainer.micro_batch_size=4"],
    # the SCAPE-99 search's scale check: 5 blocks of width 256 (4.98M parameters, 5.4x the study's), the
    # study's data, tokens per step and vocabulary
    "study_x5": ["model=llama_tiny", "model.n_layers=5", "model.d_model=256", "model.n_heads=8",
                 "model.n_kv_heads=4", "model.ffn_dim=768", "model.max_seq_len=64",
                 "data.seq_len=64", "data.tokenizer.vocab_size=2048", "data.val_tokens=8192",
                 "trainer.micro_batch_size=4"],
    "tiny": ["model=llama_tiny", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
             "model.n_kv_heads=1", "model.ffn_dim=64", "model.max_seq_len=32", "data.seq_len=32",
             "data.tokenizer.vocab_size=1024", "data.tokenizer.train_max_bytes=2000000",
             "data.val_tokens=512", "trainer.micro_batch_size=2"],
}


@dataclass(frozen=True)
class Optimizer:
    name: str
    label: str
    overrides: tuple[str, ...]
    density: float | None = None          # communicated fraction (None: dense or low-rank)
    payload_dtype: str | None = None      # SCAPE's wire format
    mask_coding: str | None = None
    parent: str | None = None             # a contender: no sweep, the parent's best lr
    seeds: int | None = None              # None: the study's --seeds


OPTIMIZERS = {o.name: o for o in [
    Optimizer("adamw", "dense AdamW", ("optimizer=adamw",)),
    Optimizer("adams", "dense AdamS", ("optimizer=adams",)),
    Optimizer("scape90", "SCAPE-90", ("optimizer=scape", "optimizer.density=0.1"), 0.1, "fp32", "auto"),
    Optimizer("scape99", "SCAPE-99", ("optimizer=scape", "optimizer.density=0.01"), 0.01, "fp32", "auto"),
    Optimizer("topk99", "top-k AdamW 99%", ("optimizer=topk_adamw", "optimizer.density=0.01"), 0.01),
    Optimizer("powersgd4", "PowerSGD rank 4", ("optimizer=powersgd", "optimizer.powersgd_rank=4")),
    # the wire format as contenders (the quantization error is fed back into the residual)
    Optimizer("scape99_bf16", "SCAPE-99 bf16 payload", ("optimizer=scape", "optimizer.density=0.01",
              "optimizer.payload_dtype=bf16"), 0.01, "bf16", "auto", parent="scape99"),
    Optimizer("scape99_fp8", "SCAPE-99 fp8_e4m3 payload", ("optimizer=scape", "optimizer.density=0.01",
              "optimizer.payload_dtype=fp8_e4m3"), 0.01, "fp8_e4m3", "auto", parent="scape99"),
    Optimizer("scape90_fp8", "SCAPE-90 fp8_e4m3 payload", ("optimizer=scape", "optimizer.density=0.1",
              "optimizer.payload_dtype=fp8_e4m3"), 0.1, "fp8_e4m3", "auto", parent="scape90"),
    # mask coding is lossless: one seed checks that the loss is that of SCAPE-99's seed 0
    Optimizer("scape99_ef", "SCAPE-99 Elias-Fano masks", ("optimizer=scape", "optimizer.density=0.01",
              "optimizer.mask_coding=elias_fano"), 0.01, "fp32", "elias_fano", parent="scape99",
              seeds=1),
]}
GAPS = {"scape90": 0.02, "scape99": 0.04}   # the paper's margins vs dense AdamS (GPT-345M)
BASELINE = "adams"
LR_GRID = (1e-3, 2e-3, 4e-3)                # log-spaced, factor 2

# Seconds a run costs on the 2-core machine, measured with the ``study`` shape and 4 ranks:
# 200-step runs took 35 s (AdamS), 37 s (SCAPE-99), 46 s (top-k 99%) end to end, i.e. ~16 s of
# start-up plus 0.093 / 0.095 / 0.12 s per step; one 1000-step SCAPE-99 run through this script
# took 176 s with the shared machine at a load average of 6-8 (0.16 s per step). Finished runs
# replace these figures with their own (and scale the others by the load they saw).
STARTUP_S = 16.0
STEP_S = {"adamw": 0.093, "adams": 0.093, "powersgd4": 0.10, "topk99": 0.12, "scape": 0.095}
EVAL_S = 0.2


@dataclass
class Run:
    optimizer: str
    lr: float
    seed: int
    steps: int
    stage: str

    @property
    def id(self) -> str:
        return f"{self.optimizer}_lr{self.lr:g}_s{self.seed}_h{self.steps}"


@dataclass
class Settings:
    ranks: int = 4
    shape: str = "study"
    main_horizon: int = 1000
    horizons: tuple[int, ...] = (300, 1000, 3000)
    horizon_optimizers: tuple[str, ...] = ("adams", "scape90", "scape99")
    seeds: int = 3
    lrs: tuple[float, ...] = LR_GRID
    optimizers: tuple[str, ...] = tuple(OPTIMIZERS)
    extra: tuple[str, ...] = ()
    one_seed: tuple[str, ...] = ()        # optimizers cut to their sweep run (budget)
    cuts: tuple[str, ...] = ()


# ------------------------------------------------------------------------------ the runs


def common_overrides(steps: int, lr: float, seed: int, shape: str,
                     checkpoint_every: int = 0) -> list[str]:
    """Every study run's trainer overrides: the lr schedule and evaluations are fractions of the
    run (10%); the seed sets init and data order (a shuffled stream); checkpoints only at the
    end unless ``checkpoint_every``. One torch thread per rank (the ranks share 2 cores: 2
    threads each made a step 1.7x slower) and no sample at the end: neither changes a loss."""
    tenth = max(1, steps // 10)
    return [*SHAPES[shape], "data=classics", "data.shuffle_buffer=64",
            f"data.seed={1000 + seed}", f"trainer.seed={1000 + seed}",
            f"trainer.max_steps={steps}", f"trainer.warmup_steps={tenth}",
            f"trainer.eval_every={tenth}", f"trainer.log_every={max(1, steps // 50)}",
            f"trainer.checkpoint_every={checkpoint_every}", "trainer.num_threads=1",
            "trainer.sample_tokens=0", f"optimizer.lr={lr:g}", f"optimizer.min_lr={lr / 10:g}",
            "logging.wandb.mode=disabled", "logging.progress_bar=false"]


def run_overrides(run: Run, s: Settings) -> list[str]:
    """The common overrides, the optimizer's, and SCAPE's density warm-up over 10% of the run."""
    opt = OPTIMIZERS[run.optimizer]
    tenth = max(1, run.steps // 10)
    return [*common_overrides(run.steps, run.lr, run.seed, s.shape), *opt.overrides,
            # SCAPE's density warm-up (and top-k's, so that both sparsify at the same density)
            *([f"optimizer.density_warmup_steps={tenth}"] if opt.density is not None else []),
            *s.extra]


def command(run: Run, s: Settings, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={s.ranks}", "-m", "scape_train", *run_overrides(run, s),
            f"run_dir={run_dir}", f"run_name=study_{run.id}"]


# Every study run's environment: one thread per rank (ranks share the machine's cores), nothing
# fetched from a hub, no W&B.
TRAINER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_MODE": "disabled"}

# The paths whose content is the code a run executes: a change elsewhere (the study's own JSON
# and pages under docs/, run outputs) leaves a run's code clean.
CODE_PATHS = ("scape_train", "scripts", "configs", "pyproject.toml")


def code_state(repo: Path = REPO) -> dict[str, Any]:
    """The code's commit in ``repo`` (the worktree the runs execute from): the last commit that
    changed :data:`CODE_PATHS`, so that committing results there leaves it (and the runs' pairing
    and resumption) unchanged; and whether the code differs from it (tracked changes or new
    files under those paths)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                              text=True).stdout.strip()
    return {"commit": git("log", "-1", "--format=%H", "HEAD", "--", *CODE_PATHS),
            "dirty": bool(git("status", "--porcelain", "--", *CODE_PATHS))}


def series(rows: list[dict], key: str) -> list[list[float]]:
    return [[r["step"], r[key]] for r in rows if key in r]


def collect(run: Run, run_dir: Path, wall_s: float, cmd: list[str], diverged: bool = False,
            code: dict | None = None) -> dict[str, Any]:
    """The run's record, with ``code`` (:func:`code_state` when it started). A diverged run
    (non-finite loss: the trainer stops) is a result too, with ``final_val_loss`` None: the
    sweep ranks it last, the statistics leave it out."""
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line] \
        if metrics.exists() else []
    opt = OPTIMIZERS[run.optimizer]
    val = series(rows, "val_loss")
    if not diverged and (not val or val[-1][0] != run.steps):
        raise RuntimeError(f"{run.id}: no final validation loss at step {run.steps} in {run_dir}")
    kind = "scape" if run.optimizer.startswith("scape") else "topk"
    return {
        "id": run.id, "optimizer": run.optimizer, "label": opt.label, "lr": run.lr,
        "seed": run.seed, "steps": run.steps, "stage": run.stage, "density": opt.density,
        "payload_dtype": opt.payload_dtype, "mask_coding": opt.mask_coding,
        "final_val_loss": None if diverged else val[-1][1], "diverged": diverged, "val_loss": val,
        "train_loss": series(rows, "loss"),
        "residual_norm": series(rows, f"{kind}/residual_norm"),
        "mask_overlap": series(rows, f"{kind}/mask_overlap"),
        "density_series": series(rows, "scape/density"),
        "tokens": max((r.get("tokens", 0) for r in rows), default=0),
        "sent_bytes": run_sent_bytes(rows),
        "wall_s": round(wall_s, 2),
        "command": shlex.join(cmd).replace(str(REPO) + "/", ""),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(code or code_state()),
    }


def run_sent_bytes(rows: list[dict]) -> int | None:
    """Data bytes rank 0 sent over the whole run (the trainer's ``comm/total_sent_bytes``)."""
    totals = [r["comm/total_sent_bytes"] for r in rows if "comm/total_sent_bytes" in r]
    return int(totals[-1]) if totals else None


def study_lock(runs_dir: Path, script: str):
    """The study directory's lock, held open (one invocation at a time per directory); None,
    said on stderr, while another invocation holds it."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    lock = open(runs_dir / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another {script} is running on {runs_dir}; exiting", file=sys.stderr)
        lock.close()
        return None
    return lock


def cli(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s status; a refused pairing is an error message, status 2; a stop
    (SIGTERM while a run trained) a line saying so, status 143 (128 + SIGTERM), as the trainer."""
    try:
        sys.exit(main())
    except MixedCommitsError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except Stopped as stop:
        print(f"stopped: {stop}", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)


class Stopped(Exception):
    """This study process got SIGTERM while a child ran; the child got it too and has exited
    (a trainer checkpoints first, so a resumable run continues where it stopped)."""

    def __init__(self, what: str, wall_s: float):
        super().__init__(f"{what} after {wall_s:.0f} s; start the study again to go on")
        self.wall_s = wall_s


def wait_passing_stop(proc: subprocess.Popen, what: str) -> int:
    """``proc``'s exit status. A SIGTERM to this process meanwhile is passed on to ``proc`` (not
    a kill: a trainer saves a checkpoint at SIGTERM, and a study tool passes it on again), and
    once ``proc`` has exited, :class:`Stopped` is raised with the seconds it ran."""
    start, stopped = time.perf_counter(), []

    def pass_on(signum, frame):
        stopped.append(signum)
        proc.send_signal(signal.SIGTERM)
    before = signal.signal(signal.SIGTERM, pass_on)
    try:
        rc = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, before)
    if stopped:
        raise Stopped(what, time.perf_counter() - start)
    return rc


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_results(runs_dir: Path) -> dict[str, dict]:
    out = {}
    for f in sorted(runs_dir.glob("*/result.json")):
        r = json.loads(f.read_text())
        out[r["id"]] = r
    return out


def json_runs(json_path: Path, unrecorded_commit: str | None = None) -> dict[str, dict]:
    """The runs a study's JSON holds (so a report renders from the JSON alone). A run that
    records no commit takes the one the JSON says its runs came from (its ``code_commit``, or
    ``unrecorded_commit``), marked ``commit_source: json``; without either it stays without one,
    and pairing it is refused."""
    if not json_path.exists():
        return {}
    data = json.loads(json_path.read_text())
    known = unrecorded_commit or data.get("code_commit")
    out = {}
    for r in data.get("runs", []):
        if r.get("commit") is None and known:
            r = {**r, "commit": known, "dirty": False, "commit_source": "json"}
        out[r["id"]] = r
    return out


def run_trainer(cmd: list[str], run_dir: Path, run_id: str, log=print, resume: bool = False
                ) -> tuple[float, bool]:
    """Run one training command into ``run_dir`` (its log: ``train.log``): (wall seconds,
    diverged). An unfinished earlier attempt is started again, or with ``resume`` (the command
    carries ``resume=auto`` and checkpoints) continued from its last checkpoint, its log
    appended to; a failure other than a non-finite loss raises with the log's end, a SIGTERM
    :class:`Stopped` once the trainer has exited (``wait_passing_stop``)."""
    if run_dir.exists() and not resume:
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **TRAINER_ENV,
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log(f"== {run_id}: {shlex.join(cmd)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(run_dir / "train.log", "a" if resume else "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_passing_stop(proc, run_id)
    wall = time.perf_counter() - start
    text = (run_dir / "train.log").read_text()
    # the trainer's NonFiniteLossError: "non-finite loss (nan) at step N. ..."
    diverged = proc.returncode != 0 and re.search(r"non-finite loss \(.*?\) at step \d+", text) is not None
    if proc.returncode != 0 and not diverged:
        raise RuntimeError(f"{run_id} failed (exit {proc.returncode}); log {run_dir}/train.log:\n"
                           f"{text[-3000:]}")
    return wall, diverged


def execute(run: Run, s: Settings, runs_dir: Path, keep_checkpoints: bool, log=print) -> dict:
    run_dir = runs_dir / run.id
    cmd = command(run, s, run_dir / "train")
    code = code_state()
    wall, diverged = run_trainer(cmd, run_dir, f"{run.stage} {run.id}", log)
    result = collect(run, run_dir / "train", wall, cmd, diverged, code)
    if not keep_checkpoints:
        shutil.rmtree(run_dir / "train" / "checkpoints", ignore_errors=True)
    write_atomic(run_dir / "result.json", json.dumps(result, indent=1))
    log(f"   diverged (non-finite loss) after {wall:.0f} s" if diverged else
        f"   final val loss {result['final_val_loss']:.4f} in {wall:.0f} s")
    return result


# ------------------------------------------------------------------------------ the plan


def _sweep_done(results: dict[str, dict], opt: str, steps: int) -> dict[float, float]:
    return {r["lr"]: math.inf if r["final_val_loss"] is None else r["final_val_loss"]
            for r in results.values() if r["optimizer"] == opt
            and r["seed"] == 0 and r["steps"] == steps and r["stage"] == "sweep"}


def best_lr(results: dict[str, dict], opt: str, s: Settings) -> float | None:
    """The sweep's lr with the lowest final validation loss (seed 0, main horizon); None until
    every lr of the sweep (its edge extension included) has finished."""
    parent = OPTIMIZERS[opt].parent or opt
    done = _sweep_done(results, parent, s.main_horizon)
    if not done or any(lr not in done for lr in sweep_lrs(results, parent, s)):
        return None
    best = min(done, key=done.get)
    return None if math.isinf(done[best]) else best   # every lr diverged: no best


def sweep_lrs(results: dict[str, dict], opt: str, s: Settings) -> list[float]:
    """The grid and the finished sweep runs' lrs, plus one lr beyond the edge (once) when the
    finished grid's best is at an edge."""
    grid = sorted(s.lrs)
    done = _sweep_done(results, opt, s.main_horizon)
    lrs = sorted(set(grid) | set(done))
    if len(grid) >= 3 and all(lr in done for lr in grid) and len(lrs) == len(grid):
        factor, best = grid[1] / grid[0], min(done, key=done.get)
        if best == lrs[-1]:
            lrs.append(float(f"{best * factor:.3g}"))
        elif best == lrs[0]:
            lrs.insert(0, float(f"{best / factor:.3g}"))
    return lrs


def plan(results: dict[str, dict], s: Settings) -> list[tuple[Run, bool]]:
    """Every run of the study as (run, ready): a seeds/horizons run is not ready until its lr is
    known (it is planned at the grid's middle lr for the estimate)."""
    mid = sorted(s.lrs)[len(s.lrs) // 2]
    out: list[tuple[Run, bool]] = []
    seen: set[str] = set()

    def add(run: Run, ready: bool) -> None:
        if run.id not in seen:
            seen.add(run.id)
            out.append((run, ready))

    opts = [o for o in s.optimizers if o in OPTIMIZERS]
    for o in opts:
        if OPTIMIZERS[o].parent is None:
            for lr in sweep_lrs(results, o, s):
                add(Run(o, lr, 0, s.main_horizon, "sweep"), True)
    for o in opts:
        lr = best_lr(results, o, s)
        n = 1 if o in s.one_seed else (OPTIMIZERS[o].seeds or s.seeds)
        for seed in range(n):
            add(Run(o, lr if lr is not None else mid, seed, s.main_horizon, "seeds"), lr is not None)
    for steps in s.horizons:
        if steps == s.main_horizon:
            continue
        for o in s.horizon_optimizers:
            if o not in opts:
                continue
            lr = best_lr(results, o, s)
            for seed in range(s.seeds):
                add(Run(o, lr if lr is not None else mid, seed, steps, "horizons"), lr is not None)
    return out


def _family(opt: str) -> str:
    return "scape" if opt.startswith("scape") else opt


def _measured_step_s(r: dict) -> float:
    return (r["wall_s"] - STARTUP_S - EVAL_S * 10) / r["steps"]


def step_seconds(results: dict[str, dict], opt: str) -> float:
    """Seconds per step: the median of this optimizer family's finished runs; without any, the
    measured default scaled by how much slower (or faster) the finished runs of the other
    families ran than their defaults (the machine's load)."""
    fam = _family(opt)
    long = [r for r in results.values() if r["steps"] >= 100 and not r.get("diverged")]
    own = sorted(_measured_step_s(r) for r in long if _family(r["optimizer"]) == fam)
    if own:
        return own[len(own) // 2]
    ratios = sorted(_measured_step_s(r) / STEP_S[_family(r["optimizer"])] for r in long
                    if _family(r["optimizer"]) in STEP_S)
    return STEP_S.get(fam, STEP_S["scape"]) * (ratios[len(ratios) // 2] if ratios else 1.0)


def estimate_s(run: Run, results: dict[str, dict]) -> float:
    return STARTUP_S + run.steps * step_seconds(results, run.optimizer) + 10 * EVAL_S


def stage_filter(planned, stage: str, only: list[str] | None):
    return [(r, ok) for r, ok in planned if (stage == "all" or r.stage == stage)
            and (not only or r.optimizer in only)]


# What the study gives up, in order, when its estimate exceeds the budget.
CUTS: list[tuple[str, Callable[[Settings], None]]] = [
    ("the fp8 SCAPE-90 contender", lambda s: setattr(
        s, "optimizers", tuple(o for o in s.optimizers if o != "scape90_fp8"))),
    ("the Elias-Fano (lossless) contender", lambda s: setattr(
        s, "optimizers", tuple(o for o in s.optimizers if o != "scape99_ef"))),
    ("SCAPE-90 at the non-main horizons", lambda s: setattr(
        s, "horizon_optimizers", tuple(o for o in s.horizon_optimizers if o != "scape90"))),
    ("dense AdamW and PowerSGD to their sweep run (1 seed)", lambda s: setattr(
        s, "one_seed", (*s.one_seed, "adamw", "powersgd4"))),
    ("the contenders to 1 seed", lambda s: setattr(
        s, "one_seed", (*s.one_seed, *(o for o in OPTIMIZERS if OPTIMIZERS[o].parent)))),
]


def plan_total(results, planned) -> float:
    """Finished runs' wall time plus the estimate of the rest, in seconds."""
    return sum(results[r.id]["wall_s"] if r.id in results else estimate_s(r, results)
               for r, _ in planned)


def apply_budget(results, base: Settings, budget_h: float, cut: bool = True
                 ) -> tuple[Settings, list, float]:
    """(settings, plan, total seconds), with CUTS applied in order while over the budget."""
    s = replace(base, cuts=())
    planned = plan(results, s)
    for name, fn in CUTS if cut else []:
        if plan_total(results, planned) <= budget_h * 3600:
            break
        fn(s)
        s.cuts = (*s.cuts, name)
        planned = plan(results, s)
    return s, planned, plan_total(results, planned)


# ------------------------------------------------------------------------------ statistics


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """Student-t quantile (two-sided 95%: p=0.975) by bisection on a Simpson-integrated CDF."""
    if df < 1:
        raise ValueError("df >= 1")
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float) -> float:  # for x >= 0; substitute u = atan(t) to integrate on a finite range
        hi, n = math.atan(x), 2000
        h = hi / n

        def f(u: float) -> float:
            t = math.tan(u)
            return c * (1 + t * t / df) ** (-(df + 1) / 2) / math.cos(u) ** 2
        acc = f(0) + f(hi) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
        return 0.5 + acc * h / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def paired_gap(a: dict[int, float], b: dict[int, float]) -> dict[str, Any] | None:
    """Mean of a[seed] - b[seed] over the seeds both have, with a 95% t-interval."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    d = [a[k] - b[k] for k in seeds]
    n, mean = len(d), sum(d) / len(d)
    if n < 2:
        return {"n": n, "seeds": seeds, "mean": mean, "sd": None, "lo": None, "hi": None, "diffs": d}
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return {"n": n, "seeds": seeds, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half,
            "diffs": d}


class MixedCommitsError(ValueError):
    """Runs to be paired did not all run the same code."""


def run_commit(r: dict) -> str | None:
    """The code a run executed: its commit, ``+dirty`` when the code differed from it; None when
    the run records none."""
    c = r.get("commit")
    return None if c is None else c + ("+dirty" if r.get("dirty") else "")


def same_training(r: dict) -> set[str]:
    """The commits ``r`` counts as for pairing: its own (:func:`run_commit`) and those its record
    names in ``same_training_as``, each a commit at which the run's setting was shown to train
    bit for bit as at its own (``{"commit": ..., "evidence": ...}``: how it was checked)."""
    own = run_commit(r)
    if own is None:
        return set()
    proven = set()
    for e in r.get("same_training_as", []):
        if not e.get("commit") or not e.get("evidence"):
            raise ValueError(f"{r['id']}: a same_training_as entry needs a commit and the evidence "
                             f"that the run's setting trains identically there; got {e}")
        proven.add(e["commit"])
    return {own, *proven}


def one_commit(runs: list[dict], what: str) -> str:
    """The one commit of ``runs``: every run's own, or one its record proves it trains the same
    at (:func:`same_training`); raises :class:`MixedCommitsError` naming every run and its commit
    when no commit is common to all or some run records none."""
    commits = {r["id"]: run_commit(r) for r in runs}
    missing = sorted(i for i, c in commits.items() if c is None)
    if missing:
        raise MixedCommitsError(
            f"{what}: cannot pair runs that record no commit: {', '.join(missing)}. If the "
            "commit their code ran at is known, record it as the JSON's code_commit "
            "(--unrecorded-commit COMMIT); else rerun them")
    common = set.intersection(*(same_training(r) for r in runs))
    if not common:
        by = {}
        for i, c in sorted(commits.items()):
            by.setdefault(c, []).append(i)
        raise MixedCommitsError(
            f"{what}: refusing to pair runs of different commits: "
            + "; ".join(f"{c}: {', '.join(ids)}" for c, ids in by.items())
            + ". Rerun the runs of the older commit at the newer one (same command), or record "
            "in a run's same_training_as the commit its setting was shown to train identically at")
    own = [c for c in commits.values() if c in common]     # prefer the commit most runs ran at
    return max(sorted(common), key=own.count)


def paired(a: list[dict], b: list[dict], what: str, seeds=None) -> dict[str, Any] | None:
    """:func:`paired_gap` of the final validation losses of runs ``a`` against ``b`` (seed by
    seed, optionally only ``seeds``), refusing (:class:`MixedCommitsError`) runs of different
    commits among the pairs; the gap records their commit and, in ``same_training``, the runs
    that count at it by their ``same_training_as`` record rather than their own commit."""
    fa = {r["seed"]: r for r in a if r["final_val_loss"] is not None}
    fb = {r["seed"]: r for r in b if r["final_val_loss"] is not None}
    both = sorted(set(fa) & set(fb) & (set(seeds) if seeds is not None else set(fa)))
    if not both:
        return None
    runs = [fa[k] for k in both] + [fb[k] for k in both]
    commit = one_commit(runs, what)
    g = paired_gap({k: fa[k]["final_val_loss"] for k in both},
                   {k: fb[k]["final_val_loss"] for k in both})
    moved = sorted(r["id"] for r in runs if run_commit(r) != commit)
    return {**g, "commit": commit, **({"same_training": moved} if moved else {})}


def finals(results, opt: str, steps: int, lr: float | None) -> dict[int, float]:
    return {r["seed"]: r["final_val_loss"] for r in finished(results, opt, steps, lr)}


def finished(results, opt: str, steps: int, lr: float | None) -> list[dict]:
    """The finished (not diverged) runs of ``opt`` at ``steps`` and ``lr``."""
    return [r for r in results.values()
            if r["optimizer"] == opt and r["steps"] == steps and lr is not None
            and math.isclose(r["lr"], lr) and r["final_val_loss"] is not None]


def summarize(results: dict[str, dict], s: Settings) -> dict[str, Any]:
    lrs = {o: best_lr(results, o, s) for o in OPTIMIZERS}
    table = {}
    for o, opt in OPTIMIZERS.items():
        f = finals(results, o, s.main_horizon, lrs[o])
        if f:
            v = list(f.values())
            mean = sum(v) / len(v)
            sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None
            gap = paired(finished(results, o, s.main_horizon, lrs[o]),
                         finished(results, BASELINE, s.main_horizon, lrs[BASELINE]),
                         f"{opt.label} vs {OPTIMIZERS[BASELINE].label} at {s.main_horizon} steps")
            table[o] = {"label": opt.label, "lr": lrs[o], "n": len(v), "mean": mean, "sd": sd,
                        "diverged": sum(1 for r in results.values() if r["optimizer"] == o and
                                        r["final_val_loss"] is None and r["steps"] == s.main_horizon
                                        and math.isclose(r["lr"], lrs[o])),
                        "gap": gap, "wall_s": sum(r["wall_s"] for r in results.values()
                                                  if r["optimizer"] == o)}
    gaps = {o: {} for o in GAPS}
    for o in GAPS:
        for steps in sorted({r["steps"] for r in results.values()}):
            g = paired(finished(results, o, steps, lrs[o]),
                       finished(results, BASELINE, steps, lrs[BASELINE]),
                       f"{OPTIMIZERS[o].label} vs {OPTIMIZERS[BASELINE].label} at {steps} steps")
            if g:
                gaps[o][steps] = g
    sweeps = {o: sorted(([r["lr"], r["final_val_loss"]] for r in results.values()
                         if r["optimizer"] == o and r["stage"] == "sweep"), key=lambda x: x[0])
              for o in OPTIMIZERS}
    return {"best_lr": lrs, "table": table, "gaps": gaps, "sweeps": {k: v for k, v in sweeps.items() if v}}


def statement(o: str, steps: int, g: dict | None) -> str:
    margin, sparsity = GAPS[o], {"scape90": "90%", "scape99": "99%"}[o]
    head = (f"{sparsity} sparsity: SCAPE matches dense AdamS within the paper's margins (0.02 at "
            f"90%, 0.04 at 99%) at horizon {steps}: ")
    if g is None:
        return head + "not measured"
    if g["lo"] is None:
        return head + f"no (one paired seed: no interval), gap {g['mean']:+.4f}"
    yes = g["hi"] <= margin
    why = "" if yes else (" (the mean is within the margin, the interval is not)"
                          if g["mean"] <= margin else "")
    return head + (f"{'yes' if yes else 'no'}{why}, gap {g['mean']:+.4f} "
                   f"[{g['lo']:+.4f}, {g['hi']:+.4f}] over {g['n']} seeds")


# ------------------------------------------------------------------------------ outputs


def mean_curve(runs: list[dict], key: str = "val_loss"):
    steps = [st for st, _ in runs[0][key]]
    vals = [[dict((int(a), b) for a, b in r[key]).get(st) for r in runs] for st in steps]
    keep = [(st, v) for st, v in zip(steps, vals) if all(x is not None for x in v)]
    return ([st for st, _ in keep], [sum(v) / len(v) for _, v in keep],
            [min(v) for _, v in keep], [max(v) for _, v in keep])



def _save_figure(fig, axes, path: Path) -> Path:
    """Grid, legend (when anything is labelled), tight layout; written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

def plot(results, summary, s: Settings, fig_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    # 1. validation loss vs step at the best lr, mean over seeds, band = min..max
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    for o, row in summary["table"].items():
        runs = [r for r in results.values() if r["optimizer"] == o and r["steps"] == s.main_horizon
                and math.isclose(r["lr"], row["lr"]) and r["final_val_loss"] is not None]
        st, mean, lo, hi = mean_curve(runs)
        line, = ax.plot(st, mean, "-", lw=1.4, label=f"{row['label']} (lr {row['lr']:g}, {len(runs)} seeds)")
        ax.fill_between(st, lo, hi, color=line.get_color(), alpha=0.18)
    ax.set(xlabel="step", ylabel="validation loss (nats/token)",
           title=f"{s.main_horizon} steps, best lr per optimizer; band: seed min-max")
    paths.append(_save_figure(fig, [ax], fig_dir / "quality_study_curves.png"))
    # 2. the gap vs horizon with its 95% interval
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=110)
    for i, (o, per) in enumerate(summary["gaps"].items()):
        hs = sorted(per)
        if not hs:
            continue
        mean = [per[h]["mean"] for h in hs]
        err = [[0 if per[h]["lo"] is None else per[h]["mean"] - per[h]["lo"] for h in hs],
               [0 if per[h]["hi"] is None else per[h]["hi"] - per[h]["mean"] for h in hs]]
        x = [h * (1 + 0.03 * (2 * i - 1)) for h in hs]
        line = ax.errorbar(x, mean, yerr=err, fmt="o-", capsize=4, label=OPTIMIZERS[o].label)
        ax.axhline(GAPS[o], ls="--", lw=1, color=line[0].get_color(),
                   label=f"margin {GAPS[o]} ({OPTIMIZERS[o].label})")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set(xlabel="horizon (steps)", ylabel="val loss gap vs dense AdamS",
           title="SCAPE - AdamS, paired seeds, 95% t-interval")
    paths.append(_save_figure(fig, [ax], fig_dir / "quality_study_gap.png"))
    # 3. the mechanisms: residual norm and mask overlap over steps (seed 0, best lr, main horizon)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for o in ("scape90", "scape99", "topk99"):
        row = summary["table"].get(o)
        runs = [r for r in results.values() if row and r["optimizer"] == o and r["seed"] == 0
                and r["steps"] == s.main_horizon and math.isclose(r["lr"], row["lr"])
                and r["final_val_loss"] is not None]
        for ax, key in zip(axes, ("residual_norm", "mask_overlap")):
            if runs and runs[0][key]:
                ax.plot(*zip(*runs[0][key]), "-", lw=1.2, label=OPTIMIZERS[o].label)
    axes[0].set(xlabel="step", ylabel="rank 0 residual norm", yscale="log",
                title="error-feedback residual (SCAPE: momentum; top-k: raw gradient)")
    axes[1].set(xlabel="step", ylabel="|M_t & M_{t-1}| / |M_t|", title="consecutive-mask overlap")
    paths.append(_save_figure(fig, axes, fig_dir / "quality_study_mechanisms.png"))
    return paths


def regen_command(s: Settings) -> str:
    """The command line that plans this study (non-default settings spelled out)."""
    d, args = Settings(), []
    if s.ranks != d.ranks:
        args += ["--ranks", str(s.ranks)]
    if s.shape != d.shape:
        args += ["--shape", s.shape]
    if s.main_horizon != d.main_horizon:
        args += ["--main-horizon", str(s.main_horizon)]
    if s.horizons != d.horizons:
        args += ["--horizons", *map(str, s.horizons)]
    if s.seeds != d.seeds:
        args += ["--seeds", str(s.seeds)]
    if s.lrs != d.lrs:
        args += ["--lrs", *(f"{x:g}" for x in s.lrs)]
    if s.optimizers != d.optimizers:
        args += ["--optimizers", *s.optimizers]
    if s.extra:
        args += ["--extra", *s.extra]
    return shlex.join([".venv/bin/python", "scripts/study_quality.py", *args])


def mechanisms(results, summary, s: Settings) -> list[dict]:
    """Seed-0 residual norm (start of the sparse phase, end) and mean mask overlap over the
    second half of the main-horizon run at the best lr, for SCAPE and top-k."""
    rows = []
    for o in ("scape90", "scape99", "topk99", "scape99_bf16", "scape99_fp8", "scape90_fp8"):
        row = summary["table"].get(o)
        run = next((r for r in results.values() if row and r["optimizer"] == o and r["seed"] == 0
                    and r["steps"] == s.main_horizon and math.isclose(r["lr"], row["lr"])
                    and r["final_val_loss"] is not None), None)
        if run is None or not run["residual_norm"]:
            continue
        half = [v for st, v in run["mask_overlap"] if st > run["steps"] / 2]
        sparse = [v for st, v in run["residual_norm"] if st > run["steps"] / 10]
        rows.append({"optimizer": o, "label": OPTIMIZERS[o].label, "density": run["density"],
                     "residual_start": sparse[0] if sparse else None,
                     "residual_end": run["residual_norm"][-1][1],
                     "residual_max": max(v for _, v in run["residual_norm"]),
                     "overlap_second_half": sum(half) / len(half) if half else None})
    return rows


def render(results, summary, s: Settings, planned, total_s: float, fig_rel: str = "figures") -> str:
    shape = " ".join(SHAPES[s.shape])
    lines = [BEGIN, "", "## The convergence study", ""]
    lines += [f"Model and data: `{shape} data=classics` ({s.ranks} gloo ranks on the CPU); seed k "
              f"sets `trainer.seed` and `data.seed` (=1000+k, a shuffled stream), so every optimizer "
              f"of a seed sees identical tokens. Per optimizer: lr sweep {', '.join(f'{x:g}' for x in s.lrs)} "
              f"at {s.main_horizon} steps (seed 0; best = lowest final validation loss), then "
              f"{s.seeds} seeds at the best lr; horizons {', '.join(map(str, s.horizons))} steps for "
              f"{', '.join(OPTIMIZERS[o].label for o in s.horizon_optimizers)}, each with warm-up, "
              "evaluations and SCAPE's (and top-k's) density warm-up at 10% of the run, cosine to lr/10. "
              "Gaps are paired over seeds (SCAPE - AdamS on the same seed), mean and 95% t-interval; "
              "\"yes\" means the whole interval is within the margin.", "",
              "Optimizers: " + ", ".join(
                  OPTIMIZERS[o].label + (f" (at {OPTIMIZERS[OPTIMIZERS[o].parent].label}'s best lr"
                                         f"{', 1 seed' if OPTIMIZERS[o].seeds == 1 else ''})"
                                         if OPTIMIZERS[o].parent else "")
                  for o in s.optimizers) + ". If the script's estimate exceeds its budget "
              "(`--budget-hours`, default 3), it cuts, in this order: "
              + "; ".join(name for name, _ in CUTS) + ".", ""]
    if not results:
        lines += ["**The study has not been run yet.** Its plan: "
                  f"{len(planned)} runs, about {total_s / 3600:.1f} h on 2 CPU cores by the script's "
                  "estimate. Run it (in pieces if need be; finished runs are skipped):", "",
                  "```", regen_command(s), "```", "",
                  f"`{regen_command(s)} --dry-run` prints the plan and the estimate.", "", END]
        return "\n".join(lines) + "\n"
    done = sum(1 for r, _ in planned if r.id in results)
    lines += [f"Runs finished: {done} of {len(planned)} planned"
              + (f" (cut for time: {'; '.join(s.cuts)})" if s.cuts else "") + ".", ""]
    for o, per in summary["gaps"].items():
        for steps in sorted(set(s.horizons) | set(per)):
            lines.append(f"- {statement(o, steps, per.get(steps))}")
    lines += ["", f"At {s.main_horizon} steps, best lr per optimizer:", "",
              "| optimizer | best lr | seeds | final val loss (mean ± sd) | vs dense AdamS, paired [95% CI] | wall time (s, all its runs) |",
              "|---|---|---|---|---|---|"]
    for o, row in summary["table"].items():
        g = row["gap"]
        sd = f" ± {row['sd']:.4f}" if row["sd"] is not None else ""
        gap = "n/a" if g is None else (f"{g['mean']:+.4f}" + ("" if g["lo"] is None else
                                                           f" [{g['lo']:+.4f}, {g['hi']:+.4f}]"))
        div = f" ({row['diverged']} diverged, left out)" if row["diverged"] else ""
        lines.append(f"| {row['label']} | {row['lr']:g} | {row['n']}{div} | {row['mean']:.4f}{sd} | {gap} | "
                     f"{row['wall_s']:.0f} |")
    lines += ["", "Learning-rate sweeps (seed 0, final validation loss):", "",
              "| optimizer | lr: final val loss |", "|---|---|"]
    for o, pts in summary["sweeps"].items():
        lines.append(f"| {OPTIMIZERS[o].label} | " + ", ".join(
            f"{lr:g}: " + ("diverged" if v is None else f"{v:.4f}") for lr, v in pts) + " |")
    lines += ["", "Gap vs horizon (SCAPE - dense AdamS, paired seeds):", "",
              "| optimizer | horizon | seeds | gap mean | 95% CI |", "|---|---|---|---|---|"]
    for o, per in summary["gaps"].items():
        for steps, g in sorted(per.items()):
            ci = "n/a" if g["lo"] is None else f"[{g['lo']:+.4f}, {g['hi']:+.4f}]"
            lines.append(f"| {OPTIMIZERS[o].label} | {steps} | {g['n']} | {g['mean']:+.4f} | {ci} |")
    mech = mechanisms(results, summary, s)
    if mech:
        def f(v):
            return "n/a" if v is None else f"{v:.4g}"
        lines += ["", "The mechanisms (seed 0, best lr; residual norm of rank 0's error-feedback "
                  "residual: SCAPE's is of the AdamS momentum, top-k's of the raw gradient):", "",
                  "| optimizer | density | residual norm after the density warm-up | at the end | max | mean mask overlap, 2nd half |",
                  "|---|---|---|---|---|---|"]
        for m in mech:
            lines.append(f"| {m['label']} | {m['density']:g} | {f(m['residual_start'])} | "
                         f"{f(m['residual_end'])} | {f(m['residual_max'])} | {f(m['overlap_second_half'])} |")
    lines += ["", f"![validation loss]({fig_rel}/quality_study_curves.png)",
              f"![gap vs horizon]({fig_rel}/quality_study_gap.png)",
              f"![residual norm and mask overlap]({fig_rel}/quality_study_mechanisms.png)", "",
              "Every run's settings, curves, residual-norm and mask-overlap series and wall time: "
              f"`{fig_rel}/quality_study.json` (each run's exact command is in it).", "",
              "Regenerate (runs only what is missing, in pieces with `--stage sweep|seeds|horizons`, "
              "`--only NAME...`, `--max-runs N`; `--dry-run` prints the plan and its estimate; "
              "`--report-only` rewrites this section, the JSON and the figures from the finished "
              "runs):", "", "```", regen_command(s), f"{regen_command(s)} --report-only", "```", "", END]
    return "\n".join(lines) + "\n"


def write_outputs(results, s: Settings, planned, total_s, json_path: Path, report: Path,
                  figures: bool = True) -> dict:
    summary = summarize(results, s)
    summary["mechanisms"] = mechanisms(results, summary, s)
    payload = {"settings": {**asdict(s), "shape_overrides": SHAPES[s.shape]},
               "summary": summary, "runs": sorted(results.values(), key=lambda r: r["id"])}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(json_path, json.dumps(payload, indent=1))
    if figures and results:
        plot(results, summary, s, json_path.parent)
    fig_rel = os.path.relpath(json_path.parent, report.parent)
    section = render(results, summary, s, planned, total_s, fig_rel)
    old = report.read_text() if report.exists() else "# Quality on real text\n"
    write_atomic(report, doc_sections.replace_section(old, "study_quality", section, str(report),
                                                      append=True))
    return payload


# ------------------------------------------------------------------------------ main


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=["sweep", "seeds", "horizons", "all"], default="all")
    p.add_argument("--only", nargs="*", help="optimizers to run now (default: all)", choices=list(OPTIMIZERS))
    p.add_argument("--max-runs", type=int, default=0, help="stop after this many runs (0 = all)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the estimate; run nothing")
    p.add_argument("--report-only", action="store_true", help="rewrite JSON, figures and doc; run nothing")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--shape", choices=list(SHAPES), default="study")
    p.add_argument("--main-horizon", type=int, default=1000)
    p.add_argument("--horizons", type=int, nargs="+", default=[300, 1000, 3000])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lrs", type=float, nargs="+", default=list(LR_GRID))
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS),
                   help="the study's optimizers (the plan); --only picks what runs now")
    p.add_argument("--budget-hours", type=float, default=3.0)
    p.add_argument("--no-cuts", action="store_true", help="plan everything whatever the estimate")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--out-dir", default=str(REPO / "outputs" / "study_quality"))
    p.add_argument("--json", default=str(REPO / "docs" / "figures" / "quality_study.json"))
    p.add_argument("--report", default=str(REPO / "docs" / "quality.md"))
    p.add_argument("--extra", nargs="*", default=[], help="more trainer overrides for every run")
    p.add_argument("--unrecorded-commit", default=None,
                   help="the commit that the JSON's runs without a recorded commit ran at")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    base = Settings(ranks=a.ranks, shape=a.shape, main_horizon=a.main_horizon,
                 horizons=tuple(sorted(set(a.horizons) | {a.main_horizon})),
                 horizon_optimizers=tuple(o for o in ("adams", "scape90", "scape99") if o in a.optimizers),
                 seeds=a.seeds, lrs=tuple(sorted(a.lrs)), optimizers=tuple(a.optimizers),
                 extra=tuple(a.extra))
    runs_dir = Path(a.out_dir) / "runs"
    results = {**json_runs(Path(a.json), a.unrecorded_commit), **load_results(runs_dir)}
    s, planned, total = apply_budget(results, base, a.budget_hours, not a.no_cuts)
    todo = [(r, ok) for r, ok in stage_filter(planned, a.stage, a.only) if r.id not in results]
    remaining = sum(estimate_s(r, results) for r, _ in todo)
    print(f"plan: {len(planned)} runs, {sum(r.id in results for r, _ in planned)} finished; "
          f"estimated total {total / 3600:.2f} h on this machine (budget {a.budget_hours:g} h), "
          f"remaining for this selection {len(todo)} runs, {remaining / 60:.0f} min")
    if s.cuts:
        print("over budget, cut: " + "; ".join(s.cuts))
    unswept = [o for o in s.optimizers if OPTIMIZERS[o].parent is None
               and best_lr(results, o, s) is None]
    if unswept:
        worst = sum(estimate_s(Run(o, 0.0, 0, s.main_horizon, "sweep"), results) for o in unswept)
        print(f"plus up to {len(unswept)} sweep runs ({worst / 60:.0f} min) if a best lr lands on "
              "the grid's edge (one more lr beyond it)")
    if a.dry_run:
        for stage in ("sweep", "seeds", "horizons"):
            rows = [(r, ok) for r, ok in planned if r.stage == stage]
            est = sum(results[r.id]["wall_s"] if r.id in results else estimate_s(r, results) for r, _ in rows)
            print(f"[{stage}] {len(rows)} runs, {est / 60:.0f} min")
            for r, ok in rows:
                state = "done" if r.id in results else ("ready" if ok else "waits for the sweep")
                print(f"  {r.id:34s} {state:20s} ~{estimate_s(r, results):.0f} s")
        return 0
    json_path, report = Path(a.json), Path(a.report)
    lock = study_lock(runs_dir, "study_quality.py")
    if lock is None:
        return 1
    try:
        ran = 0
        while not a.report_only:
            todo = [(r, ok) for r, ok in stage_filter(planned, a.stage, a.only) if r.id not in results]
            ready = [r for r, ok in todo if ok]
            if not ready or (a.max_runs and ran >= a.max_runs):
                if todo and not ready:
                    print(f"{len(todo)} runs wait for their sweep (run --stage sweep first)")
                break
            run = ready[0]
            results[run.id] = execute(run, s, runs_dir, a.keep_checkpoints)
            ran += 1
            s, planned, total = apply_budget(results, base, a.budget_hours, not a.no_cuts)
            write_outputs(results, s, planned, total, json_path, report)
        write_outputs(results, s, planned, total, json_path, report)
        print(f"ran {ran} runs; wrote {json_path} and {report}")
        return 0
    finally:
        lock.close()


if __name__ == "__main__":
    cli(main)
