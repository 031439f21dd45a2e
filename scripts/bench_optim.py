#!/usr/bin/env python
"""Optimizer step time on the CPU, a ~50M-parameter Llama: dense AdamW/AdamS vs SCAPE's local step.

    .venv/bin/python scripts/bench_optim.py [--repeats 7] [--threads 1] [--world 4] \
        [--docs docs/figures]

Every timing is the project's own ``strategy.step`` with random gradients (filling them is not
timed). SCAPE runs as ONE rank (rank 0) of a ``--world``-rank tensor partition: its top-k covers
that rank's range (a quarter of the model for 4 ranks), and the collectives are replaced by local
stand-ins (:class:`LocalComm`: the all-reduce keeps the rank's own payload, the reduce-scatter
keeps its own chunk, the all-gathers fill the other ranks' rows with a valid mask / their values),
so the figure is the local work of one rank, no communication. Contenders (dense AdamW, dense
AdamS, SCAPE reference and fused, replicated and sharded, at densities 0.1 and 0.01; the default
``mask_coding=auto`` (Elias-Fano at these densities) and, for the fused replicated step, the
``bitmap`` coding, cheaper to decode, larger on the wire) ALTERNATE:
each round runs one step of each, and the table gives medians over rounds (after warm-up rounds).

Per SCAPE step the phases are timed by wrapping the strategy's methods (CPU ops are synchronous):
gradients (flat copy for the reference path), candidate + residual (``prepare``), payload / ĝ /
clip / AdamS (``update``), the owner's top-k, the mask encode + gather start, the end-of-step
residual fold, and the mask wait + decode. ``B/param``: bytes read + written per parameter by the
dispatched ops of one step (:class:`scape_train.profiling.DeviceOpCounter`'s ``bytes_moved``).
Written: bench_optim.json and bench_optim_table.md under ``--docs``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
import doc_sections  # noqa: E402

from scape_train.models import build_model  # noqa: E402
from scape_train.models.config import ModelConfig  # noqa: E402
from scape_train.optim import build_optimizer  # noqa: E402
from scape_train.comm import Comm, Handle  # noqa: E402
from scape_train.optim.config import OptimizerConfig  # noqa: E402
from scape_train.optim.grad_buffer import write_grads  # noqa: E402
from scape_train.optim.scape import strategy as scape_strategy  # noqa: E402
from scape_train.optim.scape.masks import topk_own_mask  # noqa: E402
from scape_train.profiling import DeviceOpCounter, held_tensors, storage_bytes  # noqa: E402

# 8 blocks of width 640 and an 8k vocab: ~50M parameters (10.5M of them in the embeddings).
MODEL = ModelConfig(name="llama_50m", arch="llama", n_layers=8, d_model=640, n_heads=10,
                    n_kv_heads=2, ffn_dim=2048, max_seq_len=256, vocab_size=8192)


class LocalComm(Comm):
    """Rank ``rank`` of a ``world``-rank group whose collectives are local stand-ins (shapes and
    the work around them as in a real run; no data moves between processes)."""

    def __init__(self, world: int, rank: int = 0):
        super().__init__()
        self.world, self.rank = world, rank
        self.mask_rows: torch.Tensor | None = None   # every rank's coded next-mask bytes

    def all_reduce(self, tensor, *, kind, average=True, op="sum", async_op=False):
        return Handle(self, kind)

    def all_gather(self, output, shard, *, kind, async_op=False):
        rows = output.view(self.world, -1)
        if kind == "mask" and self.mask_rows is not None:
            rows.copy_(self.mask_rows.view(self.world, -1))
            rows[self.rank].copy_(shard.view(-1))
        else:
            rows.copy_(shard.view(1, -1).expand_as(rows))
        return Handle(self, kind)

    def reduce_scatter(self, output, input, *, kind, average=True, async_op=False):
        output.copy_(input.view(self.world, -1)[self.rank])
        return Handle(self, kind)


def fill_grads(model: torch.nn.Module, seed: int, strategy=None) -> None:
    """Random gradients, where a backward would put them (``strategy``'s flat buffer, if any)."""
    g = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    write_grads(params, [torch.randn(p.shape, generator=g) * 1e-2 for p in params],
                getattr(strategy, "grad_buffer", None))


class Phases:
    """Wall time per phase of one SCAPE step, by wrapping the strategy's methods."""

    def __init__(self, s):
        self.t: dict[str, float] = defaultdict(float)
        self._wrap(s, "_flat_grads", "gradients: flat copy")
        self._wrap(s, "_grads", "gradients: flat copy")   # fused: views, ~0
        self._wrap(s, "_next", "mask wait + decode")
        for eng in (e for e in (s.reference, s.fused) if e is not None):
            self._wrap(eng, "prepare", "candidate + residual (prepare)")
            self._wrap(eng, "update", "payload, ĝ, clip, AdamS (update)")
            self._wrap(eng, "finish_step", "residual fold + norm (finish_step)")
        self._wrap(s.exchange, "start", "mask encode + gather start")

    def _wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0, topk0 = time.perf_counter(), _TOPK_T["t"]
            try:
                return fn(*a, **k)
            finally:    # the top-k runs inside the fused update (overlapping the payload's
                # collective): its own row counts it, not this one
                self.t[label] += time.perf_counter() - t0 - (_TOPK_T["t"] - topk0)

        setattr(obj, name, timed)


_TOPK_T = defaultdict(float)


def _timed_topk(*a, **k):
    t0 = time.perf_counter()
    try:
        return topk_own_mask(*a, **k)
    finally:
        _TOPK_T["t"] += time.perf_counter() - t0


scape_strategy.topk_own_mask = _timed_topk   # the strategy's top-k, timed


def build(model, name: str, world: int, kw: dict):
    if name != "scape":
        return build_optimizer(OptimizerConfig(name=name, **kw), model), None
    comm = LocalComm(world)
    s = build_optimizer(OptimizerConfig(**{"name": "scape", "density_warmup_steps": 0,
                                           "use_triton": "off", **kw}), model, comm)
    d = kw["density"]
    stat = torch.randn(s.layout.total, generator=torch.Generator().manual_seed(7))
    plan = s.exchange.plan(d)
    rows = [plan.encode(topk_own_mask(stat[lo:hi], s.part, r, s.layout, d), r, s.passes)
            for r, (lo, hi) in enumerate(s.part.ranges)]
    comm.mask_rows = torch.cat([r.view(-1) for r in rows])
    return s, Phases(s)


def step_bytes(s, model, params: int) -> float:
    fill_grads(model, 999, s)
    with DeviceOpCounter() as ops:
        s.step(1e-3)
    return ops.bytes_moved / params


def held_bytes(s, model, params: int) -> float:
    """Bytes per parameter the optimizer holds between steps (every tensor reachable from it:
    state, masks, index vectors, pools and caches), beyond the parameters and their gradients
    (SCAPE's flat gradient buffer is the gradients)."""
    roots = [s] + ([list(s.optimizer.state.values())] if getattr(s, "optimizer", None) else [])
    own = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    buf = getattr(s, "grad_buffer", None)
    own += [] if buf is None else [buf.buffer]
    return (storage_bytes(held_tensors(*roots) + own) - storage_bytes(own)) / params


def run(model, contenders: dict, repeats: int, warmup: int) -> dict:
    built = {name: build(model, *spec) for name, spec in contenders.items()}
    params = sum(p.numel() for p in model.parameters())
    res: dict[str, dict] = {n: {"times": [], "phases": defaultdict(list)} for n in contenders}
    for i in range(warmup + repeats):
        for name, (s, ph) in built.items():        # alternate the contenders every round
            fill_grads(model, i, s)
            if ph is not None:
                ph.t.clear()
                _TOPK_T.clear()
            t0 = time.perf_counter()
            s.step(1e-3)
            dt = time.perf_counter() - t0
            s.zero_grad()
            if i >= warmup:
                res[name]["times"].append(dt)
                if ph is not None:
                    for k, v in ph.t.items():
                        res[name]["phases"][k].append(v)
                    res[name]["phases"]["top-k (own range)"].append(_TOPK_T["t"])
    out = {}
    for name, (s, ph) in built.items():
        t = res[name]["times"]
        row = {"median": statistics.median(t), "min": min(t), "max": max(t), "n": len(t),
               "bytes_per_param": step_bytes(s, model, params),
               "held_per_param": held_bytes(s, model, params)}
        if ph is not None:
            phases = {k: statistics.median(v) for k, v in res[name]["phases"].items()}
            ph_sum = sum(phases.values())
            phases["other (metrics, bookkeeping)"] = max(0.0, row["median"] - ph_sum)
            row["phases"] = phases
        s.close()
        out[name] = row
    return out


def table(res: dict) -> str:
    steps = res["steps"]
    base = steps["AdamS + clip"]["median"]
    lines = [f"Model: {res['params'] / 1e6:.1f}M parameters, {res['threads']} thread(s), "
             f"SCAPE as rank 0 of {res['world']} (tensor partition: top-k over its range), "
             f"load {res['load_before']:.2f} -> {res['load_after']:.2f} (1-min avg, "
             f"{res['cpus']} CPUs); median (min-max) of {res['repeats']} alternating rounds "
             f"after {res['warmup']} warm-up rounds.", "",
             "| optimizer step | seconds | vs AdamS | B/param (dispatched ops) | "
             "B/param held between steps |",
             "|---|---|---|---|---|"]
    for name, s in steps.items():
        held = s.get("held_per_param")
        lines.append(f"| {name} | {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | "
                     f"{s['median'] / base:.2f}x | {s['bytes_per_param']:.0f} | "
                     f"{'' if held is None else f'{held:.2f}'} |")
    scape = [n for n in steps if "phases" in steps[n]]
    labels: list[str] = []
    for n in scape:
        labels += [k for k in steps[n]["phases"] if k not in labels]
    lines += ["", "SCAPE per-phase split (seconds, median per round):", "",
              "| phase | " + " | ".join(scape) + " |", "|---|" + "---|" * len(scape)]
    for k in labels:
        cells = [f"{steps[n]['phases'].get(k, 0.0):.3f}" for n in scape]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--densities", default="0.1,0.01")
    p.add_argument("--no-sharded", action="store_true", help="skip the sharded SCAPE contenders")
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(MODEL, device="cpu")
    contenders: dict[str, tuple] = {"AdamW (torch, foreach) + clip": ("adamw", 1, {}),
                                    "AdamS + clip": ("adams", 1, {})}
    for d in map(float, args.densities.split(",")):
        for impl in ("reference", "fused"):
            contenders[f"SCAPE {impl}, d={d}"] = ("scape", args.world, dict(
                density=d, scape_impl=impl))
        contenders[f"SCAPE fused, d={d}, bitmap mask"] = ("scape", args.world, dict(
            density=d, scape_impl="fused", mask_coding="bitmap"))
        if not args.no_sharded:
            contenders[f"SCAPE fused sharded, d={d}"] = ("scape", args.world, dict(
                density=d, scape_impl="fused", sharded=True))
    res = {"params": sum(p.numel() for p in model.parameters()), "threads": args.threads,
           "world": args.world, "repeats": args.repeats, "warmup": args.warmup,
           "cpus": os.cpu_count(), "load_before": os.getloadavg()[0]}
    res["steps"] = run(model, contenders, args.repeats, args.warmup)
    res["load_after"] = os.getloadavg()[0]
    write_results(args.docs, "bench_optim", res, table(res))
    doc_sections.update("bench_optim", figures=args.docs)


def write_results(docs: str, stem: str, res: dict, table_md: str) -> None:
    """``<stem>.json`` and ``<stem>_table.md`` under ``docs``; the table printed too."""
    out = Path(docs)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}_table.md").write_text(table_md)
    print(table_md)


if __name__ == "__main__":
    main()
