#!/usr/bin/env python
"""Host syncs and kernel launches per optimizer step, counted: dense vs SCAPE replicated vs sharded.

    .venv/bin/python scripts/bench_device_ops.py [--world 8] [--steps 8]

``--only NAME`` counts only the contenders whose name contains NAME. Dense AdamS's Triton kernel
runs on CPU tensors only under ``TRITON_INTERPRET=1``; without it its row is skipped (its
launches are the kernel's own count, as a GPU would issue them).

Counts are taken at the dispatcher by ``scape_train.profiling.DeviceOpCounter`` (what each count
means is in its docstring) on real gloo ranks, over ``strategy.step`` with the gradients already
in place, averaged over steps 3..N (step 1 builds SCAPE's first mask synchronously; step 2 is the
first with a mask gathered during the previous step). The model has Llama-500M's structure (16
blocks: the tensors, and so the segments every count depends on, of the paper's model) at width
64, so 8 ranks fit on a laptop; the counts do not depend on the width. Written:
``docs/figures/bench_device_ops.json`` and its section of ``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

import doc_sections  # noqa: E402
from _dist import run_distributed  # noqa: E402

from scape_train.models import build_model  # noqa: E402
from scape_train.models.config import ModelConfig  # noqa: E402

# Llama-500M's structure (configs/model/llama500m.yaml), width 64.
MODEL = ModelConfig(name="llama500m_structure", arch="llama", n_layers=16, d_model=64, n_heads=4,
                    n_kv_heads=2, ffn_dim=160, max_seq_len=64, vocab_size=512)

_S = dict(name="scape", clip_grad=1.0)
CONTENDERS = {
    "AdamW (DDP)": dict(name="adamw", clip_grad=1.0),
    "AdamS (DDP)": dict(name="adams", clip_grad=1.0),
    "AdamS (DDP), Triton": dict(name="adams", clip_grad=1.0, use_triton="on"),
    "SCAPE-99 replicated": dict(_S, density=0.01),
    "SCAPE-99 sharded (flat)": dict(_S, density=0.01, sharded=True, partitioner="flat"),
    "SCAPE-99 sharded (tensor)": dict(_S, density=0.01, sharded=True, partitioner="tensor"),
    # a new density, mask plan and tables every step of the counted window
    "SCAPE-90 replicated, density warm-up": dict(_S, density=0.1, density_warmup_steps=6),
    "SCAPE-90 sharded (flat), bf16, offload, warm-up": dict(
        _S, density=0.1, density_warmup_steps=6, sharded=True, partitioner="flat",
        payload_dtype="bf16", offload_residuals=True),
    "SCAPE-99 replicated, fp8": dict(_S, density=0.01, payload_dtype="fp8_e4m3"),
    "SCAPE-99 sharded (flat), fp8": dict(_S, density=0.01, payload_dtype="fp8_e4m3",
                                         sharded=True, partitioner="flat"),
}


def _worker(rank, world, kw, steps):
    from scape_train.optim import build_optimizer
    from scape_train.optim.config import OptimizerConfig
    from scape_train.profiling import DeviceOpCounter

    torch.manual_seed(0)
    model = build_model(MODEL, vocab_size=MODEL.vocab_size, device=torch.device("cpu"))
    strategy = build_optimizer(OptimizerConfig(**kw), model)
    wrapped = strategy.wrap_model(model)
    rows = []
    for t in range(1, steps + 1):
        g = torch.Generator().manual_seed(100 * t + rank)
        x = torch.randint(0, MODEL.vocab_size, (2, 32), generator=g)
        with DeviceOpCounter() as fb:
            loss = torch.nn.functional.cross_entropy(wrapped(x).flatten(0, 1), x.flatten())
            loss.backward()
        with DeviceOpCounter() as ops:
            strategy.step(1e-3)
        strategy.zero_grad()
        rows.append({"syncs": ops.host_syncs, "sites": dict(ops.sync_sites),
                     "launches": ops.launches, "fwd_bwd_launches": fb.launches})
    strategy.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--docs", default=str(REPO / "docs"))
    ap.add_argument("--only", default="", help="count only the contenders whose name contains it")
    args = ap.parse_args()
    from scape_train.optim.adams import triton_usable
    n_params = sum(p.numel() for p in build_model(MODEL, vocab_size=MODEL.vocab_size,
                                                  device=torch.device("meta")).parameters())
    n_tensors = len(list(build_model(MODEL, vocab_size=MODEL.vocab_size,
                                     device=torch.device("meta")).parameters()))
    out = {"world": args.world, "steps": args.steps, "model": MODEL.name,
           "tensors": n_tensors, "params": n_params, "results": {}}
    for name, kw in CONTENDERS.items():
        if args.only not in name:
            continue
        if kw.get("use_triton") == "on" and not triton_usable(torch.device("cpu")):
            print(f"{name:28s} skipped: set TRITON_INTERPRET=1 to run the kernel on the CPU")
            continue
        per_rank = run_distributed(_worker, args.world, (kw, args.steps))
        later = [r for rows in per_rank for r in rows[2:]]
        res = {k: statistics.mean(r[k] for r in later)
               for k in ("syncs", "launches", "fwd_bwd_launches")}
        res["syncs_max_rank"] = max(r["syncs"] for r in later)
        sites: dict[str, int] = {}
        for r in later:
            for s, c in r["sites"].items():
                sites[s] = sites.get(s, 0) + c
        res["sync_sites_per_step"] = {s: c / len(later) for s, c in sorted(sites.items())}
        res["first_step_syncs"] = statistics.mean(rows[0]["syncs"] for rows in per_rank)
        out["results"][name] = res
        print(f"{name:28s} syncs/step {res['syncs']:7.1f}  launches/step {res['launches']:8.1f}  "
              f"(fwd+bwd {res['fwd_bwd_launches']:.0f})  sites {res['sync_sites_per_step']}",
              flush=True)
    figures = Path(args.docs) / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    (figures / "bench_device_ops.json").write_text(json.dumps(out, indent=1))
    print(render(out))
    doc_sections.update("bench_device_ops", figures=figures)


def render(r: dict) -> str:
    """The section of docs/gpu.md, from bench_device_ops.json."""
    lines = [f"{r['world']} gloo ranks, {r['model']} ({r['tensors']} tensors, {r['params']:,} "
             f"parameters); steps 3..{r['steps']}, mean over ranks and steps.", "",
             "| optimizer | host syncs / step | launches / step (optimizer) | "
             "launches fwd+bwd | sync sites / step |", "|---|---|---|---|---|"]
    for name, res in r["results"].items():
        sites = ", ".join(f"{k} {v:g}" for k, v in res["sync_sites_per_step"].items()) or "-"
        lines.append(f"| {name} | {res['syncs']:g} | {res['launches']:.0f} | "
                     f"{res['fwd_bwd_launches']:.0f} | {sites} |")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
