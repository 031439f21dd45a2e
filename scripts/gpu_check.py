#!/usr/bin/env python
"""The one prepared GPU check: the project's most wanted CUDA figures from one device lease.

    bash scripts/gpu_check.sh             # on one GPU (installs carried wheels first): < 6 minutes
    bash scripts/gpu_check.sh --dry-run   # lists the checks and their time limits; runs nothing
    python scripts/gpu_check.py --smoke   # the checks that can, at toy sizes on the CPU (CI)
    bash scripts/gpu_check.sh --only train_sweep   # optional: the lease's time left after the rest

A lease is 15 device minutes, machine start included, one command at most 10 minutes, and only a
few small files come back. So the checks (``gpu_checks.py``) run most valuable first, each in its
own process with its own time limit (a check past it is killed with everything it started and
reported as timed out; the next one runs), all of them within DEADLINE_S; and ``--out`` ($OUT on
the device machine) receives exactly two files, ``gpu_check.json`` and ``gpu.md``, rewritten
after every check. Training runs and traces live in a temporary directory, and the training runs
are stopped after their last logged step, before the end-of-run checkpoint (GBs) is written.
Timings use CUDA events; host syncs are those CUDA reports (``torch.cuda.set_sync_debug_mode``)
and those counted at the dispatcher (``profiling.DeviceOpCounter``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from gpu_checks import CHECKS, OPTIONAL, REPO, Ctx     # this script's folder is on sys.path

DEADLINE_S = 340            # every check together, on one H200 (gpu_check.sh allows 6 minutes)


def run_child(name: str, smoke: bool, tmp: Path, limit_s: float) -> int:
    """One check, in this process (started by :func:`run_check`)."""
    results = json.loads((tmp / "results_in.json").read_text())
    try:
        res = CHECKS[name][2](Ctx(tmp, smoke, results, limit_s))
    except Exception:  # noqa: BLE001 - reported in the figures; the next check still runs
        res = {"error": traceback.format_exc().splitlines()[-12:]}
    (tmp / f"result_{name}.json").write_text(json.dumps(res, default=str))
    return 0


def run_check(name: str, limit_s: float, smoke: bool, tmp: Path, results: dict,
              running: list) -> dict:
    """``name`` in a child process of its own session, killed with all it started past
    ``limit_s``: a hung kernel or a slow check cannot starve the next ones. ``running`` holds
    it meanwhile (for the SIGTERM handler of :func:`main`)."""
    results_in, result_out = tmp / "results_in.json", tmp / f"result_{name}.json"
    results_in.write_text(json.dumps(results, default=str))
    cmd = [sys.executable, __file__, "--child", name, "--tmp", str(tmp), "--limit", str(limit_s)]
    cmd += ["--smoke"] if smoke else []
    proc = subprocess.Popen(cmd, start_new_session=True)
    running.append(proc)
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {limit_s:g} s (killed)"}
    finally:
        running.remove(proc)
        try:            # the check, or what it left behind (a trainer's data loader): gone
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if not result_out.exists():
        return {"error": f"the check's process exited {proc.returncode} without a result"}
    return json.loads(result_out.read_text())


def failed(res: dict) -> bool:
    return "error" in res or res.get("ok") is False


def write_report(out: Path, results: dict, seconds: dict, limits: dict, smoke: bool) -> None:
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    lines = ["# GPU check", "", f"`scripts/gpu_check.sh` ({'smoke, CPU' if smoke else 'device'}); "
             f"written {time.strftime('%Y-%m-%d %H:%M')}. Every figure is in `gpu_check.json`.", ""]
    for name, res in results.items():
        lines += [f"## {name}: {CHECKS[name][0]}", "",
                  f"{seconds.get(name, 0):.1f} s of {limits[name]:g} s", "",
                  "```", json.dumps(res, indent=1, default=str)[:6000], "```", ""]
    (out / "gpu.md").write_text("\n".join(lines))


def limits_of(spec: str) -> dict[str, float]:
    """``--limits scape_vs_adams_step=120,env=5``: per-check limits in seconds."""
    pairs = [item.split("=") for item in spec.split(",") if item]
    return {n: float(s) for n, s in pairs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the checks and their limits")
    ap.add_argument("--smoke", action="store_true", help="toy sizes; CPU-capable checks only")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--limits", default="", help="name=seconds,... replacing the checks' limits")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S, help="all checks together, s")
    # $OUT on the device machine; elsewhere a scratch folder (docs/gpu.md is the page, rendered
    # from a committed run by scripts/gpu_targets.py)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "outputs" / "gpu_check"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_child(args.child, args.smoke, Path(args.tmp), args.limit)
    unknown = set(filter(None, args.only.split(","))) - set(CHECKS)
    unknown |= {item.split("=")[0] for item in args.limits.split(",") if item} - set(CHECKS)
    if unknown:
        print(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    only = set(filter(None, args.only.split(",")))
    names = [n for n in CHECKS if (n in only if only else n not in OPTIONAL)]
    limits = {n: CHECKS[n][1] for n in names} | limits_of(args.limits)
    if args.dry_run:
        for n in names:
            print(f"{n:20s} {limits[n]:4.0f} s  {CHECKS[n][0]}")
        print(f"{'deadline':20s} {args.deadline:4.0f} s  all the checks together")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, seconds, running = {}, {}, []

    def stop(signum, frame):    # gpu_check.sh's backstop timeout: take the running check along
        for proc in running:
            os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for n in names:
            limits[n] = min(limits[n], args.deadline - (time.perf_counter() - start))
            print(f"== {n} (limit {limits[n]:.0f} s): {CHECKS[n][0]}", flush=True)
            t0 = time.perf_counter()
            results[n] = (run_check(n, limits[n], args.smoke, Path(tmp), results, running)
                          if limits[n] > 0 else {"error": "not run: the deadline had passed"})
            seconds[n] = time.perf_counter() - t0
            print(json.dumps(results[n], default=str)[:2000], flush=True)
            write_report(out, results, seconds, limits, args.smoke)   # a hard timeout keeps the rest
    bad = [n for n in names if failed(results[n])]
    print(f"checks failed: {bad or 'none'}; {time.perf_counter() - start:.0f} s; "
          f"report: {out / 'gpu.md'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
