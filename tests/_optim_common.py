"""Shared pieces of the optimizer tests: a tiny model, per-rank data and a training loop."""

from __future__ import annotations

import torch
from torch import nn

from scape_train.metrics import read_on_host
from scape_train.optim import build_optimizer
from scape_train.comm import Comm
from scape_train.optim.config import OptimizerConfig


def tiny_model(seed: int = 0, width: int = 24, bias: bool = True) -> nn.Module:
    """Matrices, biases and a norm gain (1-D tensors are excluded from masking)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, width, bias=bias), nn.LayerNorm(width), nn.Tanh(),
                         nn.Linear(width, 10, bias=bias))


def batch(step: int, rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 12, generator=g), torch.randn(n, 10, generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def make(cfg: OptimizerConfig, seed: int = 0, width: int = 24, bias: bool = True,
         total_steps: int = 0):
    model = tiny_model(seed, width, bias)
    strategy = build_optimizer(cfg, model, Comm(), total_steps=total_steps)
    return strategy, strategy.wrap_model(model), model


def train_step(strategy, wrapped: nn.Module, step: int, rank: int, lr: float = 1e-2,
               micro: int = 1) -> dict[str, float]:
    strategy.before_forward(step)
    x, y = batch(step, rank, 8 * micro)
    for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
        with strategy.sync_context(wrapped, i == micro - 1):
            (loss_fn(wrapped, xs, ys) / micro).backward()
    strategy.after_backward()
    metrics = read_on_host(strategy.step(lr))
    strategy.zero_grad()
    return metrics


def sent_bytes_per_kind(strategy, wrapped: nn.Module, steps, rank: int) -> list[dict[str, int]]:
    """Train ``steps`` (step numbers) and return, per step, the bytes this rank's Comm counted
    for each kind of payload (``comm/<kind>_sent_bytes``, the total left out)."""
    per_step = []
    for step in steps:
        strategy.comm.pop_stats()
        train_step(strategy, wrapped, step, rank)
        stats = strategy.comm.pop_stats()
        per_step.append({k[len("comm/"):-len("_sent_bytes")]: int(v) for k, v in stats.items()
                         if k.endswith("_sent_bytes") and k != "comm/sent_bytes"})
    return per_step
