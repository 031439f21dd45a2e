#!/usr/bin/env python
"""Under torchrun on >= 2 GPUs: is SCAPE's next-mask all-gather in flight during the next
forward/backward? (Run by ``scripts/gpu_check.py``'s ``overlap_trace`` check.)

Each rank trains a small Llama with SCAPE-99 for a few steps; steps 3-4 are profiled. Rank 0
exports the chrome trace and measures, from the kernel events, how much of the all-gather
kernels' time other streams spent computing (the overlap), into ``overlap_summary.json`` under
$SCAPE_TRACE_OUT.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scape_train.models import build_model  # noqa: E402
from scape_train.models.config import ModelConfig  # noqa: E402
from scape_train.optim import build_optimizer  # noqa: E402
from scape_train.comm import Comm  # noqa: E402
from scape_train.optim.config import OptimizerConfig  # noqa: E402


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    cfg = ModelConfig(name="overlap", arch="llama", n_layers=8, d_model=1024, n_heads=16,
                      n_kv_heads=8, ffn_dim=2816, max_seq_len=1024, vocab_size=32000)
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=cfg.vocab_size, device=dev)
    strategy = build_optimizer(OptimizerConfig(name="scape", density=0.01), model, Comm())
    x = torch.randint(0, cfg.vocab_size, (8, 1024), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        loss.backward()
        strategy.step(1e-4)
        strategy.zero_grad()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        out = Path(os.environ.get("SCAPE_TRACE_OUT", "."))
        raw = out / "trace_overlap_rank0.json"
        prof.export_chrome_trace(str(raw))
        events = json.loads(raw.read_text())["traceEvents"]
        kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
        gathers = [e for e in kernels if "AllGather" in e["name"]]
        compute = [e for e in kernels if "nccl" not in e["name"].lower()]
        overlapped = 0.0
        for g in gathers:
            a, b = g["ts"], g["ts"] + g["dur"]
            spans = sorted((max(a, c["ts"]), min(b, c["ts"] + c["dur"])) for c in compute
                           if c["ts"] < b and c["ts"] + c["dur"] > a and c.get("tid") != g.get("tid"))
            end = a
            for s, e in spans:           # union of the compute intervals inside [a, b]
                s = max(s, end)
                if e > s:
                    overlapped += e - s
                    end = e
        total = sum(g["dur"] for g in gathers)
        summary = {"allgather_kernels": len(gathers), "allgather_us": total,
                   "overlapped_us": overlapped,
                   "overlap_fraction": overlapped / total if total else None,
                   "trace": str(raw) + ".gz"}
        with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
            g.write(f.read())
        raw.unlink()
        (out / "overlap_summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary))
    strategy.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
