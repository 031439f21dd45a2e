"""Measure the real peak memory of training steps on CPU, for the plan's validation (test_plan.py).

    python -m tests._peak_memory_job KEY=VALUE ...      # overrides of the trainer's config

Builds the model and the optimizer strategy as the trainer does (``build_model``,
``build_optimizer``, the trainer's ``prepare_for_training`` and ``autocast_context``),
then runs two optimizer steps with the trainer's own loop body (so that its locals
live as long as they do there) and one ``state_dict()`` (the checkpoint's copies); random tokens,
no data pipeline. Prints one JSON line: ``peak`` = the kernel's peak resident set (VmHWM) minus the
resident set just before the model is built. The high-water mark is reset there (/proc/self/
clear_refs), after a warm-up pass of a tiny copy of the job has loaded every kernel, thread pool and
lazily imported module, so that the figure is the tensors' memory plus what the allocator keeps.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from scape_train.config import Config, grad_accum_steps
from scape_train.models import build_model
from scape_train.optim import build_optimizer
from scape_train.models.training import prepare_for_training
from scape_train.train import autocast_context
from tests.helpers import compose_config


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_steps(cfg: Config, steps: int) -> None:
    t, device = cfg.trainer, torch.device("cpu")
    vocab = cfg.model.vocab_size or cfg.data.tokenizer.vocab_size
    model = build_model(cfg.model, vocab_size=vocab, device=device)
    strategy = build_optimizer(cfg.optimizer, model)
    prepare_for_training(model, t.activation_checkpointing, compile=False,
                         loss_chunk_tokens=t.loss_chunk_tokens)
    autocast, accum = autocast_context(cfg, device), grad_accum_steps(cfg, 1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):   # the body of Trainer.train_step, minus metrics and data loading
        for _micro in range(accum):
            x = torch.randint(vocab, (t.micro_batch_size, cfg.data.seq_len), generator=gen)
            y = torch.randint(vocab, (t.micro_batch_size, cfg.data.seq_len), generator=gen)
            with autocast():
                loss = model(x, targets=y) / accum
            loss.backward()
        strategy.after_backward()
        strategy.step(1e-4)
        strategy.zero_grad()
    del loss
    strategy.state_dict()


def main(overrides: list[str]) -> None:
    torch.set_num_threads(int(os.environ.get("SCAPE_JOB_THREADS", "2")))
    cfg = compose_config(overrides)
    tiny = compose_config(overrides + ["model.n_layers=1", "model.d_model=64", "model.n_heads=2",
                                       "model.n_kv_heads=1", "model.ffn_dim=64", "data.seq_len=16",
                                       "model.vocab_size=512", "trainer.micro_batch_size=2",
                                       "trainer.global_batch_size=0"])
    run_steps(tiny, 1)                                  # warm-up: kernels, threads, imports
    baseline = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:       # reset VmHWM to the current RSS
        f.write("5")
    run_steps(cfg, 2)
    print(json.dumps({"peak": _status_bytes("VmHWM") - baseline, "baseline": baseline}))


if __name__ == "__main__":
    main(sys.argv[1:])
