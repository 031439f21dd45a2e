#!/usr/bin/env python
"""A PROJECTION (not a measurement): per-step time of dense AdamS vs SCAPE at the paper's scale.

    .venv/bin/python scripts/cost_model.py [--mfu 0.4] [--docs docs/figures]

What is exact and what is assumed:
- Bytes per rank per step: exact, from ``scape_train.optim.scape.accounting`` (the accounting
  tests/test_accounting.py checks against the bytes real SCAPE steps count), models built on the
  meta device from configs/model/*.yaml. Dense: the fp32 ring all-reduce of the whole gradient.
- Compute per step per GPU (ASSUMED): training FLOPs per token from the model's own
  ``flops_per_token`` (6N + attention, scape_train/models/layers.py) x tokens per GPU per step
  (the paper's global batch and sequence, spec §6) / (989 TFLOP/s dense bf16 H100 x MFU).
- Network (ASSUMED): every rank's bottleneck is one inter-node link of B Gbit/s in each direction
  (10, 25, 100 Gbit/s stated per GPU), a ring collective moves its counted bytes at B, plus a
  latency of ALPHA_S per ring hop (2(n-1) hops for an all-reduce, n-1 for an all-gather).
- Overlap (ASSUMED, as in Megatron/DDP and in SCAPE's design): the dense gradient all-reduce
  overlaps the backward pass (2/3 of compute), so only what exceeds it is exposed; SCAPE's payload
  all-reduce runs after backward and is fully exposed; its next-mask all-gather overlaps the next
  forward+backward (all of compute); in sharded mode the parameter all-gather is exposed too.
- Optimizer local work on the GPU (ASSUMED memory-bound): fp32 passes over all N elements at HBM
  bandwidth 3.35 TB/s: 8 passes for AdamS (read m, g, theta; write m, theta; the v temporaries),
  24 for SCAPE (candidate, residual fold, gather/scatter, masked AdamS, top-k ~ 4 passes). On the
  CPU, scripts/bench_optim.py measures the same ratio; it is larger there (see docs).

A calibration check on this machine's cluster (when docs/figures/bench_speed_summary.json exists)
applies the same formulas to the measured compute-only step, the counted bytes and the tc rate,
and prints predicted vs measured step times of the 100 Mbit/s runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import doc_sections  # noqa: E402
from bench_volume import meta_layout  # noqa: E402
from scape_train.models import build_model  # noqa: E402
from scape_train.optim.scape.accounting import dense_allreduce_bytes, scape_step_bytes  # noqa: E402

PEAK_FLOPS = 989e12          # H100 SXM dense bf16, data sheet
HBM_BPS = 3.35e12            # H100 SXM HBM3, data sheet
ALPHA_S = 10e-6              # per ring hop
BWD_FRACTION = 2.0 / 3.0     # share of compute the dense all-reduce can hide behind
PASSES = {"adams": 8, "scape": 24}
# name, vocab, label, seq, global batch (sequences), SCAPE engine (spec §6)
SETUPS = [("gpt345m", 50257, "GPT-345M", 1024, 512, False),
          ("llama500m", 32000, "Llama-500M", 4096, 1024, False),
          ("llama1_8b", 32000, "Llama-1.8B", 2048, 1024, True)]
WORLDS = [32, 64]
LINKS_GBIT = [10, 25, 100]
DENSITIES = [0.1, 0.01]


def ring_time(nbytes: float, hops: int, bps: float) -> float:
    return nbytes * 8 / bps + hops * ALPHA_S


def project(mfu: float) -> list[dict]:
    import yaml

    from scape_train.models.config import ModelConfig

    rows = []
    for name, vocab, label, seq, gbatch, sharded in SETUPS:
        layout = meta_layout(name, vocab)
        raw = yaml.safe_load((REPO / "configs" / "model" / f"{name}.yaml").read_text())
        model = build_model(ModelConfig(**raw), vocab_size=vocab, device="meta")
        fpt = model.flops_per_token(seq)
        n_el = layout.total
        for n in WORLDS:
            tokens = gbatch * seq / n
            compute = fpt * tokens / (PEAK_FLOPS * mfu)
            opt_dense = PASSES["adams"] * 4 * n_el / HBM_BPS
            opt_scape = PASSES["scape"] * 4 * n_el / HBM_BPS
            dense_b = dense_allreduce_bytes(layout, n)
            for gbit in LINKS_GBIT:
                bps = gbit * 1e9
                t_dense = ring_time(dense_b, 2 * (n - 1), bps)
                dense_step = compute + max(0.0, t_dense - BWD_FRACTION * compute) + opt_dense
                for d in DENSITIES:
                    # the spec's wire format (bitmap mask, fp32 payload); the coded masks' and
                    # low-precision payloads' bytes: docs/performance.md, section 3
                    b = scape_step_bytes(layout, n, d, partitioner="flat", sharded=sharded,
                                         mask_coding="bitmap", payload_dtype="fp32")
                    exposed = ring_time(b.payload + b.norm, 2 * (n - 1), bps)
                    exposed += ring_time(b.params, n - 1, bps) if b.params else 0.0
                    mask_over = max(0.0, ring_time(b.mask, n - 1, bps) - compute)
                    scape_step = compute + exposed + mask_over + opt_scape
                    rows.append({"model": label, "world": n, "link_gbit": gbit, "density": d,
                                 "sharded": sharded, "mfu": mfu, "compute_s": compute,
                                 "dense_comm_s": t_dense, "dense_step_s": dense_step,
                                 "scape_exposed_comm_s": exposed + mask_over,
                                 "scape_step_s": scape_step, "speedup": dense_step / scape_step,
                                 "dense_bytes": dense_b, "scape_bytes": b.total})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model | n | link Gbit/s | sparsity | compute s | dense comm s | dense step s | "
           "SCAPE exposed comm s | SCAPE step s | projected speed-up |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']}{' (sharded)' if r['sharded'] else ''} | {r['world']} | "
                   f"{r['link_gbit']} | {100 - r['density'] * 100:.0f}% | {r['compute_s']:.3f} | "
                   f"{r['dense_comm_s']:.3f} | {r['dense_step_s']:.3f} | "
                   f"{r['scape_exposed_comm_s']:.3f} | {r['scape_step_s']:.3f} | "
                   f"{r['speedup']:.2f}x |")
    return "\n".join(out) + "\n"


def calibration(docs: Path) -> str | None:
    """The same formulas on the CPU cluster's 100 Mbit/s runs, against what was measured.

    Inputs are measurements of this machine (the compute-only step, SCAPE's step over the unshaped
    link) and the exact bytes of bench_speed's model (llama_20m, vocab 8192, 4 ranks, tensor
    owners). Dense: compute + all bytes at the link rate (4 ranks on 2 cores leave no idle core to
    overlap with). SCAPE: its unshaped step + the payload at the link rate + whatever of the mask
    all-gather outlasts the next forward/backward.
    """
    path = docs / "bench_speed_summary.json"
    if not path.exists():
        return None
    summ = json.loads(path.read_text())
    rate = 100e6
    comp = summ.get("compute/100mbit", summ["compute"])["step"]["median"]
    layout = meta_layout("llama_20m", 8192)
    lines = ["| 100 Mbit/s, 4 ranks | exact MB/step (payload + mask) | predicted s | measured s "
             "(median) |", "|---|---|---|---|"]
    for opt, density in (("adams", None), ("scape90", 0.1), ("scape99", 0.01)):
        s = summ.get(f"100mbit/{opt}")
        if not s or not s["step"]["n"]:
            continue
        if density is None:
            nbytes = dense_allreduce_bytes(layout, 4)
            pred = comp + nbytes * 8 / rate
            what = f"{nbytes / 1e6:.2f}"
        else:
            b = scape_step_bytes(layout, 4, density, mask_coding="auto")     # as measured
            unl = summ.get(f"none/{opt}", {}).get("step", {}).get("median") or comp
            fwd_bwd = summ.get(f"none/{opt}", {}).get("fwd_bwd", {}).get("median") or 0.0
            pred = unl + b.payload * 8 / rate + max(0.0, b.mask * 8 / rate - fwd_bwd)
            what = f"{b.payload / 1e6:.2f} + {b.mask / 1e6:.2f}"
        lines.append(f"| {opt} | {what} | {pred:.2f} | {s['step']['median']:.2f} |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SETUPS), figsize=(13, 4), sharey=True)
    for ax, (_, _, label, *_rest) in zip(axes, SETUPS):
        for n in WORLDS:
            for d in DENSITIES:
                sel = [r for r in rows if r["model"] == label and r["world"] == n
                       and r["density"] == d]
                ax.plot([r["link_gbit"] for r in sel], [r["speedup"] for r in sel], marker="o",
                        ls="-" if d == 0.1 else "--", label=f"n={n}, {100 - d * 100:.0f}%")
        ax.set_xscale("log")
        ax.set_xlabel("inter-node link per GPU, Gbit/s")
        ax.set_title(f"{label} (PROJECTION)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("projected step speed-up vs dense AdamS")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mfu", type=float, default=0.4, help="assumed MFU of the GPU compute")
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"))
    args = p.parse_args()
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    rows = project(args.mfu)
    (docs / "cost_model.json").write_text(json.dumps(rows, indent=1))
    text = f"PROJECTION, MFU {args.mfu} (assumptions in scripts/cost_model.py)\n\n" + table(rows)
    cal = calibration(docs)
    if cal:
        text += "\nCalibration on the CPU cluster (same formulas, measured inputs):\n\n" + cal
    (docs / "cost_model_table.md").write_text(text)
    figure(rows, docs / "cost_model.png")
    print(text)
    doc_sections.update("cost_model", figures=docs)


if __name__ == "__main__":
    main()
