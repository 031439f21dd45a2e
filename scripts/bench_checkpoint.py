#!/usr/bin/env python
"""Checkpoint bytes per rank and in total for Llama-1.8B: each piece written once, against every
rank writing its full state.

    .venv/bin/python scripts/bench_checkpoint.py [--worlds 8,64] [--out docs]

Accounting, not a measurement of disk writes: the model is built on the meta device from
configs/model/llama1_8b.yaml (no memory); for every rank of every world size the strategy is
built as that rank builds it (``AccountingComm``: an assumed world size and rank, no process
group, accounting only), the state a first step creates is allocated on meta
(``materialize_for_accounting``), and the bytes come from ``checkpoint_layout.checkpoint_files`` +
``file_bytes`` -- the functions the save itself uses to decide and account what each rank writes
(tests/test_checkpoint_layout.py checks them against the bytes real 2- and 4-rank saves put on
disk). "every rank writes all" applies the naive rule -- every rank writes its full state
(replicated part, sharded state gathered to full size, its own part), the model on rank 0 -- to
the same pieces.
Per-rank data state is sized with an upper bound (the packer's pending tokens: seq_len int64).
Written: <out>/figures/bench_checkpoint.json and its section of <out>/checkpoint.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
import doc_sections  # noqa: E402

from scape_train.checkpoint_layout import (AccountingComm, checkpoint_files, file_bytes,  # noqa: E402
                                           materialize_for_accounting, trainer_parts)
from scape_train.models import build_model  # noqa: E402
from scape_train.models.config import ModelConfig  # noqa: E402
from scape_train.optim import build_optimizer  # noqa: E402
from scape_train.optim.config import OptimizerConfig  # noqa: E402
from scape_train.rng import get_rng_state  # noqa: E402

MODEL, VOCAB, SEQ_LEN = "llama1_8b", 32000, 2048
# (label, optimizer config). SCAPE sharded as configs/experiment/llama1_8b_s90.yaml (flat owners);
# its offload_residuals=true moves the residual to host memory, not out of the checkpoint, so the
# bytes are the same -- it is off here only because a host buffer would really be allocated.
STRATEGIES = [
    ("dense AdamW (DDP)", dict(name="adamw")),
    ("SCAPE replicated", dict(name="scape", density=0.1, partitioner="tensor")),
    ("SCAPE sharded (ZeRO-1)", dict(name="scape", density=0.1, partitioner="flat", sharded=True)),
]
GB = 1e9


def meta_model():
    raw = yaml.safe_load((REPO / "configs" / "model" / f"{MODEL}.yaml").read_text())
    return build_model(ModelConfig(**raw), vocab_size=VOCAB, device="meta")


def rank_bytes(model, cfg: dict, world: int, rank: int) -> dict[str, dict[str, int]]:
    """{rule: {file: bytes}} of what ``rank`` of ``world`` writes."""
    strategy = build_optimizer(OptimizerConfig(**cfg), model, AccountingComm(world, rank))
    materialize_for_accounting(strategy)
    data = {"cursor": {"epoch": 0, "shard": 0, "pos": 0, "rec": 0, "skip": 0},
            "packer": {"tokens": torch.empty(SEQ_LEN, dtype=torch.int64, device="meta")},
            "counters": {"docs": 0, "tokens": 0, "batches": 0}}
    parts = trainer_parts(strategy.checkpoint_state(), data=data, rng=get_rng_state(),
                          train={"step": 0, "tokens": 0, "nan_skips": 0, "wandb_run_id": None},
                          synchronous=strategy.synchronous)
    model_state = model.state_dict() if rank == 0 else None
    return {rule: file_bytes(checkpoint_files(rank, model_state=model_state, parts=parts, rule=rule))
            for rule in ("every_rank_full", "owner")}


def compute(worlds: list[int]) -> dict:
    model = meta_model()
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for world in worlds:
        for label, cfg in STRATEGIES:
            per_rank = {"every_rank_full": [], "owner": []}
            files = {"every_rank_full": {}, "owner": {}}
            for rank in range(world):
                for rule, fb in rank_bytes(model, cfg, world, rank).items():
                    per_rank[rule].append(sum(fb.values()))
                    files[rule].update(fb)
            row = {"strategy": label, "world": world, "config": cfg}
            for rule, key in (("every_rank_full", "before"), ("owner", "after")):
                b = per_rank[rule]
                kinds = {"model": 0, "replicated": 0, "sharded": 0, "per_rank": 0}
                for name, v in files[rule].items():
                    kind = ("model" if name == "model.pt" else "replicated" if name == "replicated.pt"
                            else "sharded" if name.startswith("shard_") else "per_rank")
                    kinds[kind] += v
                row[key] = {"max_rank_bytes": max(b), "total_bytes": sum(b), "rank0_bytes": b[0],
                            "other_rank_max_bytes": max(b[1:]) if len(b) > 1 else 0,
                            "files": len(files[rule]), "by_kind": kinds}
            rows.append(row)
            print(f"{label:24s} n={world:3d}  before: max {row['before']['max_rank_bytes'] / GB:7.2f} GB"
                  f" total {row['before']['total_bytes'] / GB:8.1f} GB   after: max "
                  f"{row['after']['max_rank_bytes'] / GB:7.2f} GB total "
                  f"{row['after']['total_bytes'] / GB:8.1f} GB", flush=True)
    return {"model": MODEL, "n_params": n_params, "vocab": VOCAB, "rows": rows}


def table(res: dict) -> str:
    out = ["| strategy | ranks | every rank writes all: max per rank GB | every rank writes all: "
           "total GB | as saved: max per rank GB (rank 0 / others) | as saved: total GB | "
           "total saved |",
           "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        b, a = r["before"], r["after"]
        out.append(f"| {r['strategy']} | {r['world']} | {b['max_rank_bytes'] / GB:.2f} | "
                   f"{b['total_bytes'] / GB:.1f} | {a['max_rank_bytes'] / GB:.2f} "
                   f"({a['rank0_bytes'] / GB:.2f} / {a['other_rank_max_bytes'] / GB:.2f}) | "
                   f"{a['total_bytes'] / GB:.1f} | {b['total_bytes'] / a['total_bytes']:.1f}x |")
    return "\n".join(out) + "\n"


def kinds_table(res: dict) -> str:
    out = ["| strategy | ranks | model GB | replicated GB | owner-sharded GB | per-rank GB (all ranks) |",
           "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        k = r["after"]["by_kind"]
        out.append(f"| {r['strategy']} | {r['world']} | {k['model'] / GB:.2f} | "
                   f"{k['replicated'] / GB:.2f} | {k['sharded'] / GB:.2f} | {k['per_rank'] / GB:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="8,64")
    p.add_argument("--out", default=str(REPO / "docs"))
    args = p.parse_args()
    t0 = time.perf_counter()
    res = compute([int(w) for w in args.worlds.split(",")])
    figures = Path(args.out) / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    (figures / "bench_checkpoint.json").write_text(json.dumps(res, indent=1))
    print(table(res))
    print(kinds_table(res))
    print(f"{time.perf_counter() - t0:.0f} s")
    doc_sections.update("bench_checkpoint", figures=figures)


if __name__ == "__main__":
    main()
