#!/usr/bin/env python
"""The trainer's tokens/s against a minimal single-file GPT loop and a bare loop over our model.

    .venv/bin/python scripts/bench_trainer.py [--rounds 3] [--steps 20] [--threads 2] \
        [--docs docs/figures]
    .venv/bin/python scripts/bench_trainer.py --shape host --rounds 3 --steps 500 --skip 20 \
        --threads 1        # the trainer's own host time per step (docs/gpu.md)

The shape (``--shape gpt``): GPT, 6 layers, width 384, 6 heads, seq 256, batch 8, vocab 50304
rows (GPT-2 BPE, 50257 tokens, padded), tied head, no biases, fp32, AdamW (clip 1.0), 2 CPU
threads. ``--shape host``: 1 block of width 32, seq 16, batch 2, the classics text's own
2048-token BPE, logging every 50 steps: compute so small that the step time difference between
the trainer and the bare loop is the trainer's own host work per step (loader, flags, metrics,
logging), which a GPU step must hide.
Three contenders, each a fresh process per round, ALTERNATING round by round:

``minimal``  a GPT written the obvious way (one fused QKV projection, SDPA, tied head, loss over
             the padded 50304 logits as nanoGPT computes it), torch AdamW, a plain loop over
             pre-made random tokens;
``bare``     the same plain loop over OUR model (``build_model``) and OUR optimizer strategy;
``trainer``  ``python -m scape_train`` itself (real data: the shipped classics text through the
             GPT-2 BPE, its loader, metrics, logging), tokens/s as it logs them.

Each reports the median step time after ``--skip`` warm-up steps (trainer: the median of its
logged ``step_time_s`` windows after the first). Ratios are of medians within the same round;
the table gives the median (min-max) of the rounds' ratios, with the load average.
Written: bench_trainer.json and bench_trainer_table.md under ``--docs`` (host:
bench_trainer_host.json, and the ``bench_trainer_host`` section of docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import doc_sections  # noqa: E402

GPT2_BPE = REPO.parent / "shared" / "data" / "tokenizers" / "gpt2"
# ``--shape``: ``gpt`` (above); ``host``, a model so small that its compute is a few ms and a step's
# host work shows: the trainer's own per-step time over the bare loop's (its loader, metrics,
# flags, logging), with the classics text's own 2048-token BPE (``tokens`` below 50257)
SHAPES = {"gpt": dict(n_layers=6, d_model=384, n_heads=6, seq=256, batch=8, vocab=50304,
                      tokens=50257, log_every=5),
          "host": dict(n_layers=1, d_model=32, n_heads=2, seq=16, batch=2, vocab=2048, tokens=2048,
                       log_every=50)}
SHAPE = dict(SHAPES["gpt"])


def trainer_overrides(run_dir: str, steps: int, threads: int) -> list[str]:
    s = SHAPE
    return ["model=gpt_tiny", f"model.n_layers={s['n_layers']}", f"model.d_model={s['d_model']}",
            f"model.n_heads={s['n_heads']}", f"model.ffn_dim={4 * s['d_model']}",
            "model.bias=false", f"model.max_seq_len={s['seq']}", "model.vocab_pad_multiple=64",
            "data=classics",
            *(["data.tokenizer.kind=gpt2", f"data.tokenizer.path={GPT2_BPE}"]
              if s["tokens"] == 50257 else []),
            f"data.tokenizer.vocab_size={s['tokens']}", f"data.seq_len={s['seq']}",
            f"trainer.micro_batch_size={s['batch']}", f"trainer.global_batch_size={s['batch']}",
            "trainer.precision=fp32", f"trainer.num_threads={threads}", f"trainer.max_steps={steps}",
            "trainer.warmup_steps=2", "trainer.eval_every=0", "trainer.checkpoint_every=0",
            f"trainer.log_every={s['log_every']}", "trainer.sample_tokens=0", "eval.enabled=false",
            "optimizer=adamw", "optimizer.clip_grad=1.0", "logging.wandb.mode=disabled",
            "logging.progress_bar=false", f"run_dir={run_dir}"]


# -- the minimal GPT (the reference a nanoGPT user has in mind) -------------------------------------
def minimal_gpt():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    s = SHAPE
    d, h = s["d_model"], s["n_heads"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
            self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
            self.fc, self.out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(s["vocab"], d), nn.Embedding(s["seq"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(s["n_layers"]))
            self.ln_f = nn.LayerNorm(d, bias=False)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return F.linear(self.ln_f(x), self.wte.weight)

    return GPT()


def _plain_loop(model, step_fn, steps: int, skip: int, loss_fn) -> dict:
    import torch

    s = SHAPE
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(s["tokens"], (steps + 1, s["batch"], s["seq"] + 1), generator=gen)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        x, y = data[i, :, :-1], data[i, :, 1:]
        loss = loss_fn(model, x, y)
        loss.backward()
        step_fn()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[skip:]), "loss": float(loss)}


def worker(kind: str, steps: int, skip: int, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if kind == "minimal":
        model = minimal_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def loss_fn(m, x, y):   # nanoGPT's: over the padded logits, pad columns included
            return F.cross_entropy(m(x).flatten(0, 1), y.flatten())

        return _plain_loop(model, step, steps, skip, loss_fn)
    if kind == "bare":
        sys.path.insert(0, str(REPO))
        from scape_train.models import build_model
        from scape_train.optim import build_optimizer
        from tests.helpers import compose_config     # the config as the CLI composes it

        with tempfile.TemporaryDirectory() as tmp:
            cfg = compose_config(trainer_overrides(tmp, steps, threads))
        model = build_model(cfg.model, vocab_size=SHAPE["tokens"], device="cpu")
        strategy = build_optimizer(cfg.optimizer, model)

        def step():
            strategy.after_backward()
            strategy.step(1e-4)
            strategy.zero_grad()

        return _plain_loop(model, step, steps, skip, lambda m, x, y: m(x, targets=y))   # as the trainer
    raise ValueError(kind)


def run_trainer(steps: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "scape_train", *trainer_overrides(f"{tmp}/run", steps, threads)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        rows = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    windows = [r["step_time_s"] for r in rows if "step_time_s" in r][1:]   # the first: warm-up
    return {"step_s": statistics.median(windows), "windows": len(windows)}


def run_worker(kind: str, steps: int, skip: int, threads: int, shape: str = "gpt") -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--steps", str(steps), "--skip", str(skip),
           "--threads", str(threads), "--shape", shape]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


RATIOS = {"trainer/minimal": "trainer / minimal GPT loop",
          "trainer/bare": "trainer / bare loop over our model",
          "bare/minimal": "bare loop / minimal GPT loop"}


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def ratio_table(out: dict) -> str:
    """The tokens/s ratios, median (min-max) over rounds (docs/performance.md's section)."""
    lines = ["| ratio (tokens/s) | median (min-max) over rounds |", "|---|---|"]
    lines += [f"| {label} | {_spread(out['ratios'][key])} |" for key, label in RATIOS.items()]
    return "\n".join(lines)


def table(out: dict) -> str:
    """Every contender's tokens/s and step time, then the ratios, from bench_trainer.json."""
    rounds, shape = out["rounds"], out["shape"]
    tokens = shape["batch"] * shape["seq"]
    lines = [f"Shape: {shape}, fp32, AdamW + clip, {out['threads']} threads, {out['steps']} steps "
             f"per contender per round, {len(rounds)} alternating rounds; load {out['load'][0]:.2f} "
             f"-> {out['load'][1]:.2f} (1-min avg, {out['cpus']} CPUs).", "",
             "| contender | tokens/s (median of rounds) | step s |", "|---|---|---|"]
    for kind in ("minimal", "bare", "trainer"):
        st = [rd[kind]["step_s"] for rd in rounds]
        lines.append(f"| {kind} | {tokens / statistics.median(st):.0f} | {_spread(st)} |")
    return "\n".join(lines + ["", ratio_table(out)])


def host_table(out: dict) -> str:
    """The ``host`` shape's step times and the trainer's own host time per step (gpu.md)."""
    rounds, shape = out["rounds"], out["shape"]
    lines = [f"{shape['n_layers']} block, width {shape['d_model']}, sequence {shape['seq']}, batch "
             f"{shape['batch']}, vocabulary {shape['vocab']}, fp32, AdamW + clip, {out['threads']} "
             f"thread(s), {out['steps']} steps per contender per round, {len(rounds)} alternating "
             f"rounds; load {out['load'][0]:.2f} -> {out['load'][1]:.2f}.", "",
             "| contender | step time, ms: median (min-max) over rounds |", "|---|---|"]
    for kind in ("minimal", "bare", "trainer"):
        st = [1e3 * rd[kind]["step_s"] for rd in rounds]
        lines.append(f"| {kind} | {_spread(st)} |")
    extra = [1e3 * (rd["trainer"]["step_s"] - rd["bare"]["step_s"]) for rd in rounds]
    lines.append(f"| trainer - bare (the trainer's own host time per step) | {_spread(extra)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", choices=["minimal", "bare"])
    p.add_argument("--docs", default=str(REPO / "docs" / "figures"))
    a = p.parse_args()
    SHAPE.update(SHAPES[a.shape])
    if a.worker:
        print(json.dumps(worker(a.worker, a.steps, a.skip, a.threads)))
        return
    if a.shape == "gpt" and not GPT2_BPE.exists():
        sys.exit(f"bench_trainer needs the GPT-2 BPE files at {GPT2_BPE} (../shared/data)")
    load0 = os.getloadavg()[0]
    rounds = []
    for r in range(a.rounds):
        order = ["minimal", "bare", "trainer"]
        order = order[r % 3:] + order[:r % 3]          # rotate who goes first
        res = {}
        for kind in order:
            res[kind] = (run_trainer(a.steps, a.threads) if kind == "trainer"
                         else run_worker(kind, a.steps, a.skip, a.threads, a.shape))
            print(f"round {r}: {kind:8s} {res[kind]['step_s']:.3f} s/step", flush=True)
        rounds.append(res)
    load1 = os.getloadavg()[0]

    def ratios(num: str, den: str) -> list[float]:
        return [rd[den]["step_s"] / rd[num]["step_s"] for rd in rounds]   # tokens/s ratio

    out = {"shape": SHAPE, "threads": a.threads, "steps": a.steps, "load": [load0, load1],
           "cpus": os.cpu_count(), "rounds": rounds,
           "ratios": {k: ratios(*k.split("/")) for k in RATIOS}}
    assert all(math.isfinite(x) for v in out["ratios"].values() for x in v)
    docs = Path(a.docs)
    docs.mkdir(parents=True, exist_ok=True)
    if a.shape == "host":
        print(host_table(out))
        (docs / "bench_trainer_host.json").write_text(json.dumps(out, indent=1))
        doc_sections.update("bench_trainer_host", figures=docs)
        return
    print(table(out))
    (docs / "bench_trainer.json").write_text(json.dumps(out, indent=1))
    (docs / "bench_trainer_table.md").write_text(table(out) + "\n")
    doc_sections.update("bench_trainer", figures=docs)


if __name__ == "__main__":
    main()
