#!/usr/bin/env python
"""What SCAPE's flat gradient buffer (``optimizer.flat_grads``) costs and saves in a whole step.

    .venv/bin/python scripts/bench_grad_buffer.py [--steps 8] [--warmup 2] [--threads 2] \
        [--docs docs/figures]

With the buffer, ``p.grad`` are views of one flat tensor: the first micro-batch's gradients are
added to a zeroed buffer (autograd otherwise keeps the tensor it made), ``zero_grad`` fills it
with zeros instead of dropping the tensors, and the step reads one contiguous range (the
reference step: no ``torch.cat``). This times forward + backward, the SCAPE step and
``zero_grad`` of the same model (the ``bench_optim`` Llama, ~50M parameters; a batch of real
shape, random tokens) with and without the buffer: two identical copies of the model, one
strategy each, ALTERNATING step by step in one process (so both see the same load). SCAPE runs
as rank 0 of 4 (``bench_optim``'s local stand-in collectives), fused, at density 0.1; with
``--impl reference`` the spec-line-by-line step instead (the dense start of a warm-up).
Written: bench_grad_buffer.json and bench_grad_buffer_table.md under ``--docs``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_optim import MODEL, build, write_results  # noqa: E402
from scape_train.models import build_model  # noqa: E402

PHASES = ("forward + backward", "SCAPE step", "zero_grad", "whole step")


def one_step(model, strategy, x, y) -> dict[str, float]:
    t0 = time.perf_counter()
    model(x, targets=y).backward()
    t1 = time.perf_counter()
    strategy.step(1e-3)
    t2 = time.perf_counter()
    strategy.zero_grad()
    t3 = time.perf_counter()
    return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--impl", choices=("fused", "reference"), default="fused")
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = build_model(MODEL, device="cpu")
    models, strategies = {}, {}
    for flat in (True, False):
        name = "flat buffer" if flat else "autograd's tensors"
        models[name] = copy.deepcopy(base)
        strategies[name], _ = build(models[name], "scape", 4, dict(
            density=0.1, scape_impl=args.impl, flat_grads=flat))
    vocab = MODEL.vocab_size
    times = {n: {ph: [] for ph in PHASES} for n in models}
    load_before = os.getloadavg()[0]
    for i in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randint(vocab, (args.batch, args.seq), generator=g)
        y = torch.randint(vocab, (args.batch, args.seq), generator=g)
        order = list(models) if i % 2 == 0 else list(models)[::-1]
        for name in order:                       # alternate which runs first
            t = one_step(models[name], strategies[name], x, y)
            if i >= args.warmup:
                for ph, v in t.items():
                    times[name][ph].append(v)
    flat_p = torch.cat([q.detach().reshape(-1) for q in models["flat buffer"].parameters()])
    auto_p = torch.cat([q.detach().reshape(-1) for q in models["autograd's tensors"].parameters()])
    res = {"params": sum(q.numel() for q in base.parameters()), "threads": args.threads,
           "batch": args.batch, "seq": args.seq, "impl": args.impl, "steps": args.steps,
           "warmup": args.warmup, "load_before": load_before, "load_after": os.getloadavg()[0],
           "parameters_equal": bool(torch.equal(flat_p, auto_p)), "times": times}
    med = {n: {ph: statistics.median(v) for ph, v in t.items()} for n, t in times.items()}
    rows = [f"Model: {res['params'] / 1e6:.1f}M parameters, batch {args.batch} x {args.seq}, "
            f"{args.threads} thread(s), SCAPE {args.impl} d=0.1 as rank 0 of 4; load "
            f"{res['load_before']:.2f} -> {res['load_after']:.2f} (1-min avg, "
            f"{os.cpu_count()} CPUs); median of {args.steps} alternating steps after "
            f"{args.warmup} warm-up; parameters after the run bit-identical: "
            f"{res['parameters_equal']}.", "",
            "| phase | flat buffer (s) | autograd's tensors (s) | flat / autograd |",
            "|---|---|---|---|"]
    a, b = med["flat buffer"], med["autograd's tensors"]
    for ph in PHASES:
        rows.append(f"| {ph} | {a[ph]:.4f} | {b[ph]:.4f} | {a[ph] / b[ph]:.3f} |")
    ratios = [fa / fb for fa, fb in zip(times["flat buffer"]["whole step"],
                                        times["autograd's tensors"]["whole step"])]
    rows += ["", f"Whole step, flat / autograd per step: median {statistics.median(ratios):.3f} "
             f"(min {min(ratios):.3f}, max {max(ratios):.3f})."]
    res["median"] = med
    write_results(args.docs, f"bench_grad_buffer{'' if args.impl == 'fused' else '_reference'}",
                  res, "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
