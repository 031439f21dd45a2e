#!/usr/bin/env python
"""Launches per steady SCAPE-99 step on the Triton path, counted on the CPU by the interpreter.

    TRITON_INTERPRET=1 .venv/bin/python scripts/bench_launches.py [--width 64] [--steps 3]

Counted as ``scripts/gpu_checks.py``'s ``scape_vs_adams_step`` counts them: one rank, SCAPE at
density 0.01 with ``use_triton=on`` and clipping, seeded gradients written into the strategy's
flat gradient buffer, ``profiling.DeviceOpCounter`` over ``strategy.step`` after ``--steps``
warm-up steps (m's support known, the plans and tables built). The model has Llama-500M's
tensor list (16 blocks, untied embeddings: 147 tensors, 114 of them masked) at width
``--width``: the launches depend on the tensor list, not on the sizes. Prints the launches,
host syncs and bytes per parameter of the step, and its launches by op; ``--json`` writes them.

The counter counts a Triton pass as one launch; some passes launch more than one kernel (a
k-sized pass: its whole blocks and its tail block apart; the AdamS pass: the weight decay, m's
zeroing, the update). ``kernels_per_step`` counts those kernels one by one, beside the torch
ops: what a GPU profile of the step shows.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scape_train.models import build_model  # noqa: E402
from scape_train.models.config import ModelConfig  # noqa: E402
from scape_train.optim import build_optimizer  # noqa: E402
from scape_train.optim.config import OptimizerConfig  # noqa: E402
from scape_train.optim.grad_buffer import write_grads  # noqa: E402
from scape_train.profiling import DeviceOpCounter  # noqa: E402
from scape_train.optim.scape import counted_launch, triton_passes  # noqa: E402

KERNELS = {"n": 0}      # Triton kernels launched while counting


def _counting(run):
    def counted(*args, **meta):
        KERNELS["n"] += 1
        return run(*args, **meta)
    return counted


counted_launch.run = triton_passes.run = _counting(counted_launch.run)


def llama500m_tensors(width: int) -> ModelConfig:
    """Llama-500M's tensor list (configs/model/llama500m.yaml's structure) at ``width``."""
    return ModelConfig(name=f"llama500m_w{width}", arch="llama", n_layers=16, d_model=width,
                       n_heads=4, n_kv_heads=2, ffn_dim=8 * width // 3 // 8 * 8 or 8,
                       max_seq_len=64, vocab_size=8 * width, tie_embeddings=False)


def count_step(model, cfg: OptimizerConfig, warmup: int) -> DeviceOpCounter:
    """The counters of one steady step of the strategy ``cfg`` builds for ``model``."""
    params = list(model.parameters())
    strategy = build_optimizer(cfg, model)

    def fill(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        write_grads(params, (torch.randn(p.shape, generator=g).mul_(1e-2) for p in params),
                    getattr(strategy, "grad_buffer", None))

    for i in range(warmup):
        fill(i)
        strategy.step(1e-4)
    fill(98)
    KERNELS["n"] = 0
    with DeviceOpCounter() as ops:
        strategy.step(1e-4)
    ops.triton_kernels = KERNELS["n"]
    strategy.close()
    for p in params:
        p.grad = None
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="warm-up steps before the counted one")
    ap.add_argument("--use-triton", default="on", choices=("on", "off"))
    ap.add_argument("--json", default="", help="write the counts here")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model(llama500m_tensors(args.width), device=torch.device("cpu"))
    n = sum(p.numel() for p in model.parameters())
    cfg = OptimizerConfig(name="scape", density=0.01, use_triton=args.use_triton, clip_grad=1.0)
    ops = count_step(model, cfg, args.steps)
    out = {"tensors": len(list(model.parameters())), "params": n,
           "use_triton": args.use_triton, "launches_per_step": ops.launches,
           "kernels_per_step": ops.launches - sum(
               c for k, c in ops.ops.items() if k.startswith("triton::")) + ops.triton_kernels,
           "host_syncs_per_step": ops.host_syncs, "sync_sites": dict(ops.sync_sites),
           "bytes_per_param": ops.bytes_moved / n,
           "ops": dict(sorted(ops.ops.items(), key=lambda kv: -kv[1]))}
    print(f"{out['tensors']} tensors, {n:,} parameters, use_triton={args.use_triton}: "
          f"{ops.launches} launches/step ({out['kernels_per_step']} kernels), "
          f"{ops.host_syncs} host syncs, "
          f"{out['bytes_per_param']:.1f} B/param")
    for name, c in out["ops"].items():
        print(f"  {c:5d}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
