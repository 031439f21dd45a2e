#!/usr/bin/env python
"""The GPU speed targets, read from one run of ``scripts/gpu_check.sh``: each target, its bound,
what the run measured, and whether it was met.

    .venv/bin/python scripts/gpu_targets.py <files_at>/gpu_check.json [--date 2026-12-05]

Copies the run's JSON to ``docs/figures/gpu_check.json`` and renders the ``gpu_targets`` section
of ``docs/gpu.md`` from it (the section is registered once that JSON is committed, so
``scripts/doc_sections.py`` and the docs lint re-render it from the JSON alone). A check that
failed, timed out or did not run leaves its targets "not measured", with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


@dataclass(frozen=True)
class Target:
    label: str
    check: str                                  # the gpu_check check that measures it
    value: Callable[[dict], float | None]       # the check's result -> the figure
    bound: float
    at_least: bool                              # True: figure >= bound meets it
    unit: str = ""
    scale: float = 1.0                          # shown as figure * scale


def _get(res: dict, *keys: str):
    for k in keys:
        if not isinstance(res, dict) or res.get(k) is None:
            return None
        res = res[k]
    return res


def _ratio(res: dict, a: tuple[str, ...], b: tuple[str, ...]) -> float | None:
    x, y = _get(res, *a), _get(res, *b)
    return x / y if x is not None and y else None


def _worst(res: dict, key: str, runs: tuple[str, ...]) -> float | None:
    vals = [_get(res, r, key) for r in runs]
    return None if any(v is None for v in vals) else max(vals)


PRESETS = ("scape99", "adams")
TARGETS = [
    Target("`llama500m_s99` as shipped: MFU", "train_throughput",
           lambda r: _get(r, "scape99", "mfu"), 0.55, True, "%", 100),
    Target("`llama500m_adams` as shipped: MFU", "train_throughput",
           lambda r: _get(r, "adams", "mfu"), 0.55, True, "%", 100),
    Target("SCAPE-99 tokens/s over AdamS's", "train_throughput",
           lambda r: _ratio(r, ("scape99", "tokens_per_s"), ("adams", "tokens_per_s")), 0.97,
           True, "x"),
    Target("data wait, share of a step (the worse preset)", "train_throughput",
           lambda r: _worst(r, "data_share_of_step", PRESETS), 0.01, False, "%", 100),
    Target("SCAPE-99 optimizer step, Llama-500M shapes", "scape_vs_adams_step",
           lambda r: _get(r, "scape99", "median_s"), 0.006, False, "ms", 1000),
    Target("SCAPE-99 step: host syncs (error mode)", "scape_vs_adams_step",
           lambda r: _get(r, "scape99", "cuda_sync", "syncs"), 0, False),
    Target("dense AdamS optimizer step", "scape_vs_adams_step",
           lambda r: _get(r, "adams", "median_s"), 0.004, False, "ms", 1000),
    Target("the trainer over a bare compiled loop, GPT-2 124M", "trainer_overhead",
           lambda r: _get(r, "trainer_over_bare"), 0.98, True, "x"),
]


def _fmt(x: float, t: Target) -> str:
    v = x * t.scale
    if t.unit == "x":
        return f"{v:.3g}x"
    return f"{v:g}" if not t.unit else f"{v:.1f} {t.unit}"


def assess(results: dict) -> list[dict]:
    """Every target: its bound, the figure (None where not measured) and why not, and whether
    it was met."""
    rows = []
    for t in TARGETS:
        res = results.get(t.check)
        why = ("the check did not run" if res is None else
               f"the check failed: {str(res['error'])[:120]}" if "error" in res else
               str(res["skipped"]) if "skipped" in res else None)
        value = None if why else t.value(res)
        if value is None and why is None:
            why = "not in the check's result"
        met = None if value is None else (value >= t.bound if t.at_least else value <= t.bound)
        rows.append({"target": t.label, "bound": ("≥ " if t.at_least else "≤ ") + _fmt(t.bound, t),
                     "value": value, "shown": "-" if value is None else _fmt(value, t),
                     "met": met, "why": why})
    return rows


def render(results: dict) -> str:
    """The ``gpu_targets`` section, from a gpu_check.json."""
    env = results.get("env", {})
    device = env.get("name") or "no CUDA device"
    meta = results.get("_run", {})
    lines = [f"{device}, torch {env.get('torch', '?')}, triton {env.get('triton', '?')}"
             + (f", NCCL {env['nccl']}" if env.get("nccl") else "")
             + (f"; {meta['date']}, commit `{meta['commit']}`" if meta else "")
             + ": `bash scripts/gpu_check.sh` (figures in `figures/gpu_check.json`).", "",
             "| target | bound | measured | met |", "|---|---|---|---|"]
    rows = assess(results)
    for r in rows:
        met = "not measured: " + r["why"] if r["met"] is None else ("yes" if r["met"] else "no")
        lines.append(f"| {r['target']} | {r['bound']} | {r['shown']} | {met} |")
    done = [r for r in rows if r["met"] is not None]
    lines += ["", f"{sum(r['met'] for r in done)} of {len(rows)} targets met; "
              f"{len(rows) - len(done)} not measured."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="the gpu_check.json a device run wrote")
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"), help="when the run was made")
    ap.add_argument("--commit", default=None, help="the commit it ran (default: HEAD)")
    ap.add_argument("--docs", default=str(REPO / "docs"), help="the docs folder to write into")
    a = ap.parse_args(argv)
    import subprocess

    results = json.loads(Path(a.json).read_text())
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                        capture_output=True, text=True).stdout.strip()
    results["_run"] = {"date": a.date, "commit": commit}
    dest = Path(a.docs) / "figures" / "gpu_check.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(results, indent=1, default=str))
    import doc_sections

    page = Path(a.docs) / "gpu.md"
    doc_sections.write_section(page, "gpu_targets", render(results), append=True)
    print(render(results))
    print(f"wrote {dest} and the gpu_targets section of {page}; commit both")
    return 0


if __name__ == "__main__":
    sys.exit(main())
