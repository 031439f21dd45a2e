#!/usr/bin/env python
"""Optimizer step time on the CPU, one rank, a ~50M-parameter Llama: AdamW, AdamS, SCAPE's local work.

    .venv/bin/python scripts/bench_optim.py [--repeats 5] [--threads 1] [--docs docs/figures]

Every timing is the project's own code path with random gradients (the timing excludes filling
them): the dense strategy's ``step`` (clip + torch AdamW foreach, or clip + AdamS) and SCAPE's
``step`` in one process (no collective runs: the world is one), plus SCAPE's local phases one by
one: flattening the gradients, the candidate and residual fold (``prepare``), the masked update
(``update``: payload gather, ĝ, clipping, masked AdamS), the owner's top-k and packing the bits.
Top-k is timed over the whole model (one owner) and over one rank's range of a 4-rank tensor
partition (what each rank of bench_speed's cluster does). Written: bench_optim.json and
bench_optim_table.md under ``--docs``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scape_train.models import build_model  # noqa: E402
from scape_train.models.config import ModelConfig  # noqa: E402
from scape_train.optim import build_optimizer  # noqa: E402
from scape_train.optim.config import OptimizerConfig  # noqa: E402
from scape_train.optim.scape.kernels import pack_bits  # noqa: E402
from scape_train.optim.scape.masks import topk_own_mask  # noqa: E402
from scape_train.optim.scape.partition import build_partition  # noqa: E402

# 8 blocks of width 640 and an 8k vocab: ~50M parameters (10.5M of them in the embeddings).
MODEL = ModelConfig(name="llama_50m", arch="llama", n_layers=8, d_model=640, n_heads=10,
                    n_kv_heads=2, ffn_dim=2048, max_seq_len=256, vocab_size=8192)


def fill_grads(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2


def timed(fn, before, repeats: int, warmup: int = 2) -> dict[str, float]:
    """``before()`` (untimed) then ``fn()`` (timed), ``warmup + repeats`` times."""
    times = []
    for i in range(warmup + repeats):
        before(i)
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "n": len(times)}


def strategy_step(name: str, model, repeats: int, **kw) -> dict[str, float]:
    strategy = build_optimizer(OptimizerConfig(name=name, **kw), model)
    res = timed(lambda: strategy.step(1e-3), lambda i: fill_grads(model, i), repeats)
    strategy.close()
    return res


def scape_phases(model, density: float, repeats: int) -> dict[str, dict[str, float]]:
    cfg = OptimizerConfig(name="scape", density=density, density_warmup_steps=0, use_triton="off")
    s = build_optimizer(cfg, model)
    lay, eng = s.layout, s.engine
    fill_grads(model, 0)
    g = s._flat_grads()
    mask = topk_own_mask(g, s.part, 0, lay, density)   # a mask of the right density
    state = {"step": 0}
    out: dict[str, dict[str, float]] = {}
    out["flatten grads"] = timed(s._flat_grads, lambda i: None, repeats)
    out["candidate + residual fold"] = timed(lambda: eng.prepare(g, mask), lambda i: None, repeats)

    def update():
        state["step"] += 1
        eng.update(mask, 1e-3, state["step"])

    out["masked update (gather, ĝ, clip, AdamS)"] = timed(update, lambda i: eng.prepare(g, mask),
                                                          repeats)
    stat = torch.randn(lay.total)
    out["top-k, whole model (1 owner)"] = timed(
        lambda: topk_own_mask(stat, s.part, 0, lay, density), lambda i: None, repeats)
    part4 = build_partition(lay, 4, "tensor")
    lo, hi = part4.ranges[0]
    out["top-k, one rank of 4 (tensor partition)"] = timed(
        lambda: topk_own_mask(stat[lo:hi], part4, 0, lay, density), lambda i: None, repeats)
    bits = topk_own_mask(stat, s.part, 0, lay, density)
    out["pack bits, whole model"] = timed(lambda: pack_bits(bits, backend="torch"), lambda i: None,
                                          repeats)
    return out


def table(res: dict) -> str:
    base = res["steps"]["AdamW (torch, foreach) + clip"]["median"]
    lines = [f"Model: {res['params'] / 1e6:.1f}M parameters, {res['threads']} thread(s), "
             f"load {res['load_before']:.1f} -> {res['load_after']:.1f}; median (min-max) of "
             f"{res['repeats']} steps after 2 warm-up steps.", "",
             "| optimizer step | seconds | vs AdamW |", "|---|---|---|"]
    for name, s in res["steps"].items():
        lines.append(f"| {name} | {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | "
                     f"{s['median'] / base:.2f}x |")
    for density, phases in res["phases"].items():
        lines += ["", f"SCAPE local phases at density {density}:", "",
                  "| phase | seconds | vs AdamW step |", "|---|---|---|"]
        for name, s in phases.items():
            lines.append(f"| {name} | {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | "
                         f"{s['median'] / base:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(MODEL, device="cpu")
    res = {"params": sum(p.numel() for p in model.parameters()), "threads": args.threads,
           "repeats": args.repeats, "load_before": os.getloadavg()[0], "steps": {}, "phases": {}}
    res["steps"]["AdamW (torch, foreach) + clip"] = strategy_step("adamw", model, args.repeats)
    res["steps"]["AdamS + clip"] = strategy_step("adams", model, args.repeats)
    for density in (0.1, 0.01):
        res["steps"][f"SCAPE step, density {density}, 1 rank"] = strategy_step(
            "scape", model, args.repeats, density=density, density_warmup_steps=0,
            use_triton="off")
        res["phases"][str(density)] = scape_phases(model, density, args.repeats)
    res["load_after"] = os.getloadavg()[0]
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "bench_optim.json").write_text(json.dumps(res, indent=1))
    (docs / "bench_optim_table.md").write_text(table(res))
    print(table(res))


if __name__ == "__main__":
    main()
