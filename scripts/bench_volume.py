#!/usr/bin/env python
"""Communication volume per rank per step for the paper's three models (analytic, exact).

    .venv/bin/python scripts/bench_volume.py [--worlds 8,32,64] [--docs docs/figures]

Each model is built on the meta device from configs/model/*.yaml (no memory), and the bytes come
from ``scape_train.optim.scape.accounting`` -- the same partition map, per-segment k, mask codings,
payload codec and collective formulas as the SCAPE engines, checked against the bytes real
multi-rank steps count by tests/test_accounting.py and tests/test_wire_dist.py. Every row has a
wire format: ``payload_dtype`` x ``mask_coding`` (fp32 + bitmap is the spec's format: the mask as packed bits).
The baselines are the ring all-reduce of the whole gradient (DDP) in fp32 and in bf16. Written:
bench_volume_table.md (every row), bench_volume_summary.md (reductions by format),
bench_volume.json, bench_volume.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
import doc_sections  # noqa: E402

from scape_train.models import build_model  # noqa: E402
from scape_train.models.config import ModelConfig  # noqa: E402
from scape_train.optim.scape.accounting import dense_allreduce_bytes, scape_step_bytes  # noqa: E402
from scape_train.optim.scape.partition import ParamLayout  # noqa: E402

MODELS = [("gpt345m", 50257, "GPT-345M"), ("llama500m", 32000, "Llama-500M"),
          ("llama1_8b", 32000, "Llama-1.8B")]
DENSITIES = [(0.1, "90%"), (0.01, "99%")]
# replicated state with whole-tensor owners (the default) and ZeRO-1 sharded state on the flat
# (distributed-optimizer) layout, as the paper's Llama-1.8B run uses.
MODES = [("replicated", "tensor", False), ("replicated", "flat", False), ("sharded", "flat", True)]
# (payload_dtype, mask_coding): the old wire format, the coded mask alone, then low-precision
# payloads (fp8_e5m2 moves exactly the bytes of fp8_e4m3).
FORMATS = [("fp32", "bitmap"), ("fp32", "auto"), ("bf16", "auto"), ("fp8_e4m3", "auto")]


def meta_layout(name: str, vocab: int) -> ParamLayout:
    raw = yaml.safe_load((REPO / "configs" / "model" / f"{name}.yaml").read_text())
    cfg = ModelConfig(**raw)
    model = build_model(cfg, vocab_size=vocab, device="meta")
    return ParamLayout(model, weight_decay=0.1, exclude_norm_bias=True)


def compute(worlds: list[int]) -> list[dict]:
    rows = []
    for name, vocab, label in MODELS:
        layout = meta_layout(name, vocab)
        for n in worlds:
            dense = dense_allreduce_bytes(layout, n)
            dense_bf16 = dense_allreduce_bytes(layout, n, itemsize=2)
            for mode, partitioner, sharded in MODES:
                for density, sparsity in DENSITIES:
                    for dtype, coding in FORMATS:
                        b = scape_step_bytes(layout, n, density, partitioner=partitioner,
                                             sharded=sharded, mask_coding=coding,
                                             payload_dtype=dtype)
                        rows.append({"model": label, "n_params": layout.total, "world": n,
                                     "mode": f"{mode}/{partitioner}", "sparsity": sparsity,
                                     "density": density, "payload_dtype": dtype,
                                     "mask_coding": coding, "dense_bytes": dense,
                                     "dense_bf16_bytes": dense_bf16, **b.as_dict(),
                                     "ratio": b.total / dense,
                                     "reduction": dense / b.total,
                                     "reduction_vs_bf16": dense_bf16 / b.total})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model (params) | n | state / owners | sparsity | payload | mask coding | payload MB "
           "| mask MB | params+norm MB | total MB | dense fp32 MB | vs dense fp32 "
           "| vs dense bf16 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} ({r['n_params'] / 1e6:.1f}M) | {r['world']} | {r['mode']} | "
                   f"{r['sparsity']} | {r['payload_dtype']} | {r['mask_coding']} | "
                   f"{r['payload'] / 1e6:.1f} | {r['mask'] / 1e6:.1f} | "
                   f"{(r['params'] + r['norm']) / 1e6:.1f} | {r['total'] / 1e6:.1f} | "
                   f"{r['dense_bytes'] / 1e6:.0f} | {r['reduction']:.1f}x | "
                   f"{r['reduction_vs_bf16']:.1f}x |")
    return "\n".join(out) + "\n"


def summary(rows: list[dict]) -> str:
    """One row per (model, n, state, sparsity): the reduction of every format vs dense fp32 (and,
    in brackets, vs a dense bf16 all-reduce)."""
    cells: dict = {}
    for r in rows:
        key = (r["model"], r["world"], r["mode"], r["sparsity"])
        cells.setdefault(key, {})[(r["payload_dtype"], r["mask_coding"])] = r
    head = " | ".join(f"{d} + {c}" for d, c in FORMATS)
    out = [f"| model | n | state / owners | sparsity | {head} |",
           "|---|---|---|---|" + "---|" * len(FORMATS)]
    for (model, n, mode, sparsity), by in cells.items():
        vals = " | ".join(f"{by[f]['reduction']:.1f}x ({by[f]['reduction_vs_bf16']:.1f}x)"
                          for f in FORMATS)
        out.append(f"| {model} | {n} | {mode} | {sparsity} | {vals} |")
    return "\n".join(out) + "\n"


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(DENSITIES), len(MODELS), figsize=(14, 7.5), sharey="row")
    colors = dict(zip(FORMATS, ["tab:gray", "tab:blue", "tab:orange", "tab:red"]))
    for row_axes, (density, sparsity) in zip(axes, DENSITIES):
        for ax, (_, _, label) in zip(row_axes, MODELS):
            for mode, partitioner, _ in MODES[1:]:          # the flat owners
                for fmt in FORMATS:
                    sel = [r for r in rows if r["model"] == label and r["density"] == density
                           and r["mode"] == f"{mode}/{partitioner}"
                           and (r["payload_dtype"], r["mask_coding"]) == fmt]
                    ax.plot([r["world"] for r in sel], [r["reduction"] for r in sel],
                            marker="o" if mode == "replicated" else "s", color=colors[fmt],
                            ls="-" if mode == "replicated" else "--",
                            label=f"{fmt[0]} + {fmt[1]} mask, {mode}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{label}, {sparsity} sparsity", fontsize=10)
            ax.set_xlabel("ranks n (flat owners)")
            ax.grid(alpha=0.3, which="both")
        row_axes[0].set_ylabel("reduction vs dense fp32 all-reduce")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="8,32,64")
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"))
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = compute(worlds)
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "bench_volume.json").write_text(json.dumps(rows, indent=1))
    (docs / "bench_volume_table.md").write_text(table(rows))
    (docs / "bench_volume_summary.md").write_text(summary(rows))
    figure(rows, docs / "bench_volume.png")
    print(summary(rows))
    doc_sections.update("bench_volume", figures=docs)


if __name__ == "__main__":
    main()
