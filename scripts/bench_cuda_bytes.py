#!/usr/bin/env python
"""Bytes per parameter of one SCAPE step on the CUDA path, counted on the CPU (no GPU here).

    .venv/bin/python scripts/bench_cuda_bytes.py [--world 4] [--densities 0.1,0.01] \
        [--docs docs/figures]

The step has one path on every device: static shapes (top-k by ``torch.topk``,
``nonzero_static``), nothing read back. Two variants of its fused step are counted:
- ``torch ops``: ``use_triton=off`` -- the fused step's torch passes
  (``optim/scape/torch_passes.py``);
- ``Triton``: ``use_triton=on`` -- the Triton passes (``optim/scape/triton_passes.py``) and the
  Triton mask kernels (the payload codec is torch ops on every device), run here by Triton's
  interpreter (``TRITON_INTERPRET=1``) on CPU tensors. The interpreter is slow, so the model is
  a ~7M-parameter Llama, not bench_optim's 50M (bytes per parameter hardly depend on the size
  at a fixed density).
Beside them, for scale: dense AdamS, on the CPU's foreach path and on CUDA's Triton kernel.

What is counted (``profiling.DeviceOpCounter``): every dispatched torch op's inputs and outputs,
and every Triton pass by the elements it reads and writes (counted in ``triton_passes.TritonPasses``) -- logical
bytes, not DRAM sectors: on a GPU a k-sized gather reads whole 32-byte sectors, so at d = 0.1
scattered 4-byte reads can cost up to 8x their count. SCAPE runs as rank 0 of ``--world``
ranks with local stand-ins for the collectives (bench_optim's ``LocalComm``); the split gives
the bytes of each phase of the step. Writes bench_cuda_bytes.json and
bench_cuda_bytes_table.md under ``--docs``. No timing: the interpreter's times mean nothing.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

import argparse  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

import doc_sections  # noqa: E402
from bench_optim import build, fill_grads, write_results  # noqa: E402

from scape_train.models import build_model  # noqa: E402
from scape_train.models.config import ModelConfig  # noqa: E402
from scape_train.profiling import DeviceOpCounter  # noqa: E402

MODEL = ModelConfig(name="llama_7m", arch="llama", n_layers=4, d_model=256, n_heads=4,
                    n_kv_heads=2, ffn_dim=688, max_seq_len=256, vocab_size=8192)
PHASES = [("s", "_grads", "gradients"), ("engine", "prepare", "prepare (candidate, residual)"),
          ("s", "_next", "mask wait + decode"),
          ("engine", "update", "update (payload, ĝ, clip, AdamS, θ, m)"),
          ("s", "exchange.start", "top-k + mask encode"),
          ("engine", "finish_step", "residual fold + norm")]


class PhaseBytes:
    """Bytes counted inside each wrapped method of one step (the rest: 'other')."""

    def __init__(self, s, counter_of):
        self.b: dict[str, int] = defaultdict(int)
        self.counter_of = counter_of
        engines = [e for e in (s.reference, s.fused) if e is not None]
        for owner, name, label in PHASES:
            for obj in [s] if owner == "s" else engines:
                attr = name
                if "." in attr:
                    first, attr = attr.split(".")
                    obj = getattr(obj, first)
                self._wrap(obj, attr, label)

    def _wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def counted(*a, **k):
            c = self.counter_of()
            before = c.bytes_moved if c else 0
            try:
                return fn(*a, **k)
            finally:
                if c:
                    self.b[label] += c.bytes_moved - before

        setattr(obj, name, counted)


def count(model, spec: tuple, steps: int, params: int) -> dict:
    s, _ = build(model, *spec)
    live: list = []
    ph = PhaseBytes(s, lambda: live[0] if live else None) if spec[0] == "scape" else None
    for i in range(steps):                     # warm-up steps: m's support, the plans
        fill_grads(model, i, s)
        s.step(1e-3)
        s.zero_grad()
    fill_grads(model, 999, s)
    if ph is not None:
        ph.b.clear()
    with DeviceOpCounter() as ops:
        live.append(ops)
        s.step(1e-3)
    s.zero_grad()
    s.close()
    row = {"bytes_per_param": ops.bytes_moved / params,
           "passes": {k: v for k, v in ops.ops.items() if k.startswith("triton::")}}
    if ph is not None:
        split = {k: v / params for k, v in ph.b.items()}
        split["other"] = row["bytes_per_param"] - sum(split.values())
        row["phases"] = split
    return row


def table(res: dict) -> str:
    rows = res["rows"]
    lines = [f"Model: {res['params'] / 1e6:.1f}M parameters; SCAPE as rank 0 of {res['world']} "
             "(tensor partition). Bytes read + written per parameter in one step, counted at "
             "the dispatcher and per pass (logical bytes; see the script's docstring).", "",
             "| step | B/param |", "|---|---|"]
    lines += [f"| {name} | {r['bytes_per_param']:.1f} |" for name, r in rows.items()]
    scape = [n for n in rows if "phases" in rows[n]]
    labels: list[str] = []
    for n in scape:
        labels += [k for k in rows[n]["phases"] if k not in labels]
    lines += ["", "Per phase (B/param):", "", "| phase | " + " | ".join(scape) + " |",
              "|---|" + "---|" * len(scape)]
    for k in labels:
        lines.append(f"| {k} | " + " | ".join(f"{rows[n]['phases'].get(k, 0.0):.1f}"
                                              for n in scape) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--densities", default="0.1,0.01")
    p.add_argument("--steps", type=int, default=2, help="warm-up steps before the counted one")
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"))
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(MODEL, device="cpu")
    params = sum(q.numel() for q in model.parameters())
    rows = {"dense AdamS + clip, foreach (the CPU's)": count(
                model, ("adams", 1, {"clip_grad": 1.0, "use_triton": "off"}), args.steps, params),
            "dense AdamS + clip, Triton (CUDA's)": count(
                model, ("adams", 1, {"clip_grad": 1.0, "use_triton": "on"}), args.steps, params)}
    for d in map(float, args.densities.split(",")):
        for sharded in (False, True):
            mode = "sharded" if sharded else "replicated"
            kw = dict(density=d, scape_impl="fused", sharded=sharded)
            rows[f"CUDA path, torch ops, {mode}, d={d}"] = count(
                model, ("scape", args.world, {**kw, "use_triton": "off"}), args.steps, params)
            rows[f"CUDA path, Triton, {mode}, d={d}"] = count(
                model, ("scape", args.world, {**kw, "use_triton": "on"}), args.steps,
                params)
            print(f"d={d} {mode}: " + ", ".join(
                f"{n.split(',')[0].split('(')[0].strip()} {r['bytes_per_param']:.1f}"
                for n, r in rows.items() if f"{mode}, d={d}" in n), flush=True)
    res = {"params": params, "world": args.world, "rows": rows}
    write_results(args.docs, "bench_cuda_bytes", res, table(res))
    doc_sections.update("bench_cuda_bytes", figures=args.docs)


if __name__ == "__main__":
    main()
