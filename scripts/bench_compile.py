#!/usr/bin/env python3
"""What ``torch.compile`` gives the fused SCAPE step's torch ops on the CPU.

Two pieces of the step, each eager against compiled (inductor), alternated in one run:
  - ``adams_k``: AdamS on the k gathered values (the fused engine's ``_adams_k``, called as the
    step calls it: ĝ, m and θ at the mask, lr and step as Python numbers);
  - ``candidate``: the full-size prepare of a general step, ``e += β1·m + (1-β1)·g`` (three
    elementwise passes eagerly, one fused loop compiled).
It also counts what the step's calling convention costs a compiled function: lr and the step
number are Python floats, so every new value is a new guard (``recompiles`` over 6 steps).

    .venv/bin/python scripts/bench_compile.py            # writes docs/figures/bench_compile.json
                                                         # and its section of docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from scape_train.optim.config import OptimizerConfig  # noqa: E402
from scape_train.optim.scape.fused import _FusedEngine  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import doc_sections  # noqa: E402



def _adams_k(cfg):
    engine = SimpleNamespace(cfg=cfg)

    def run(m_c, ghat_c, theta_c, lr, step):
        return _FusedEngine._adams_k(engine, m_c, ghat_c, theta_c, lr, step)
    return run


def _candidate(beta1: float):
    def run(e, m, g):
        return e.add_(m * beta1 + g * (1.0 - beta1))
    return run


def _time(fn, args_of, repeats: int) -> float:
    best = []
    for _ in range(repeats):
        args = args_of()
        t0 = time.perf_counter()
        fn(*args)
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def _recompiles(cfg, k: int) -> int:
    import torch._dynamo

    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    fn = torch.compile(_adams_k(cfg))
    x = [torch.randn(k) for _ in range(3)]
    for step in range(1, 7):
        fn(x[0].clone(), x[1], x[2].clone(), 1e-3 * (1 - step / 10), step)
    return int(counters["stats"]["unique_graphs"])


def render(out: dict) -> str:
    """The section of docs/performance.md, from bench_compile.json."""
    lines = [f"`scripts/bench_compile.py`: median of {out['rounds']} alternated rounds of "
             f"{out['repeats']} calls each, {out['threads']} threads, torch {out['torch']}; "
             f"load average {out['load_before'][0]:.1f} before, {out['load_after'][0]:.1f} after "
             "(loaded figures: read the ratios).", "",
             "| piece | k | eager (ms) | compiled (ms) | eager / compiled | compile (s) | "
             "same values (rtol 1e-6) |", "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        lines.append(f"| {r['piece']} | {r['k']:,} | {r['eager_ms']:.3f} | "
                     f"{r['compiled_ms']:.3f} | {r['speedup']:.2f} | {r['compile_s']:.1f} | "
                     f"{'yes' if r['allclose'] else 'no'} |")
    lines += ["", "Called as the step calls it (lr and the step number as Python floats), the "
              f"compiled `adams_k` built {out['graphs_over_6_steps']} graphs over 6 steps."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,1000000,4000000")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3, help="eager/compiled alternations")
    ap.add_argument("--docs", default=str(REPO / "docs"))
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = OptimizerConfig(name="scape")
    load = os.getloadavg()
    rows = []
    for k in (int(s) for s in a.sizes.split(",")):
        data = [torch.randn(k) for _ in range(3)]
        pieces = {
            "adams_k": (_adams_k(cfg),
                        lambda: (data[0].clone(), data[1], data[2].clone(), 1e-3, 100)),
            "candidate": (_candidate(cfg.betas[0]), lambda: (data[0].clone(), data[1], data[2])),
        }
        for name, (fn, args_of) in pieces.items():
            compiled = torch.compile(fn)
            t0 = time.perf_counter()
            compiled(*args_of())                       # the compile
            compile_s = time.perf_counter() - t0
            eager_out, comp_out = fn(*args_of()), compiled(*args_of())
            same = torch.allclose(eager_out, comp_out, rtol=1e-6, atol=1e-7)
            eager, comp = [], []
            for _ in range(a.rounds):                   # alternate the contenders
                eager.append(_time(fn, args_of, a.repeats))
                comp.append(_time(compiled, args_of, a.repeats))
            e, c = statistics.median(eager), statistics.median(comp)
            rows.append({"piece": name, "k": k, "eager_ms": e * 1e3, "compiled_ms": c * 1e3,
                         "speedup": e / c, "compile_s": compile_s, "allclose": same})
            print(f"{name:10s} k={k:>9,d}  eager {e * 1e3:8.3f} ms  compiled {c * 1e3:8.3f} ms  "
                  f"x{e / c:.2f}  (compile {compile_s:.1f} s, allclose {same})", flush=True)
    graphs = _recompiles(cfg, 1000)
    print(f"adams_k with lr and step changing over 6 steps: {graphs} graphs compiled")
    out = {"rows": rows, "graphs_over_6_steps": graphs, "load_before": load,
           "load_after": os.getloadavg(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "rounds": a.rounds, "repeats": a.repeats}
    figures = Path(a.docs) / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    (figures / "bench_compile.json").write_text(json.dumps(out, indent=1))
    print(render(out))
    doc_sections.update("bench_compile", figures=figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
