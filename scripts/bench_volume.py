#!/usr/bin/env python
"""Communication volume per rank per step for the paper's three models (analytic, exact).

    .venv/bin/python scripts/bench_volume.py [--worlds 8,32,64] [--docs docs/figures]

Each model is built on the meta device from configs/model/*.yaml (no memory), and the bytes come
from ``scape_train.optim.scape.accounting`` -- the same partition map, per-segment k, packed mask
shards and ring formulas as the SCAPE engines, checked against the bytes real multi-rank steps
count by tests/test_accounting.py. The dense baseline is the fp32 ring all-reduce of the whole
gradient (DDP). Written: bench_volume_table.md, bench_volume.json, bench_volume.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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
            for mode, partitioner, sharded in MODES:
                for density, sparsity in DENSITIES:
                    b = scape_step_bytes(layout, n, density, partitioner=partitioner,
                                         sharded=sharded)
                    rows.append({"model": label, "n_params": layout.total, "world": n,
                                 "mode": f"{mode}/{partitioner}", "sparsity": sparsity,
                                 "density": density, "dense_bytes": dense, **b.as_dict(),
                                 "ratio": b.total / dense})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model (params) | n | state / owners | sparsity | payload MB | mask MB | params+norm MB "
           "| total MB | dense all-reduce MB | ratio | reduction |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} ({r['n_params'] / 1e6:.1f}M) | {r['world']} | {r['mode']} | "
                   f"{r['sparsity']} | {r['payload'] / 1e6:.1f} | {r['mask'] / 1e6:.1f} | "
                   f"{(r['params'] + r['norm']) / 1e6:.1f} | {r['total'] / 1e6:.1f} | "
                   f"{r['dense_bytes'] / 1e6:.0f} | {r['ratio']:.4f} | {1 / r['ratio']:.1f}x |")
    return "\n".join(out) + "\n"


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(13, 4), sharey=True)
    for ax, (_, _, label) in zip(axes, MODELS):
        for mode, partitioner, _ in MODES:
            for density, sparsity in DENSITIES:
                sel = [r for r in rows if r["model"] == label and r["mode"] == f"{mode}/{partitioner}"
                       and r["density"] == density]
                ax.plot([r["world"] for r in sel], [r["ratio"] for r in sel], marker="o",
                        ls="-" if density == 0.1 else "--",
                        label=f"{sparsity} {mode}/{partitioner}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{label}: bytes per rank vs dense all-reduce")
        ax.set_xlabel("ranks n")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("SCAPE / dense bytes per rank per step")
    axes[0].legend(fontsize=7)
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
    figure(rows, docs / "bench_volume.png")
    print(table(rows))


if __name__ == "__main__":
    main()
