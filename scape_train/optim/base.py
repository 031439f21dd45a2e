"""The interface through which the trainer knows an optimizer.

Dense DDP, SCAPE and the local-step strategies all differ behind this seam, never inside the
training loop. The loop calls, per optimizer step:

    model = strategy.wrap_model(model)                 # once, at start-up (DDP for dense)
    strategy.before_forward(step)                      # before the first micro-batch
    for each micro-batch:
        with strategy.sync_context(model, is_last_micro):   # DDP no_sync on all but the last
            loss.backward()
    strategy.after_backward()                          # after the last micro-batch
    metrics = strategy.step(lr)                        # clip + update; returns scalar metrics
                                                       # (floats, or 0-d device tensors that
                                                       # the trainer reads at log steps only)
    strategy.zero_grad()

Learning rates are passed in by the trainer (its scheduler is a pure function of the step), so a
strategy never owns schedule state. Everything a strategy must carry across a restart is returned
by ``state_dict()`` (in one dict, in memory) and restored by ``load_state_dict()``. Checkpoints go
through ``checkpoint_state()`` instead, which says which part is replicated (written once, by rank
0), owner-sharded (by its owner) and per-rank (by each rank) -- see ``optim/state.py`` -- and
``load_checkpoint_state()``, which gets the replicated part, this rank's per-rank part and a
source of the sharded state. The default keeps everything per rank: always correct, never small.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any

import torch
from torch import nn

from .state import ShardSource, StateParts


class OptimizerStrategy(abc.ABC):
    """Base class: a single-process, no-communication strategy around a torch optimizer."""

    #: the torch optimizer(s) doing the local update; subclasses set it.
    optimizer: torch.optim.Optimizer | None = None

    #: False for local-step strategies (DiLoCo, GASLoC): workers may take different numbers of
    #: inner steps between exchanges, so the trainer issues no per-step collective and only
    #: validates, checkpoints and stops at sync points (see ``progress``).
    synchronous: bool = True
    #: True where ``checkpoint_state()`` holds the parameters themselves (local-step strategies:
    #: theta0 and a worker's own theta), so a healing elastic worker needs no model file.
    state_holds_params: bool = False

    def progress(self, step: int) -> int | None:
        """The step count every rank agrees on after local step ``step``, or ``None`` when this
        is not a sync point. Data-parallel strategies: every step is one. Local-step strategies
        return the nominal step (rounds done x H) at the end of each round."""
        return step

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def sync_context(self, model: nn.Module, is_last_micro: bool):
        return contextlib.nullcontext()

    def before_forward(self, step: int) -> None:
        """Called before the first micro-batch of optimizer step ``step`` (1-based)."""

    def after_backward(self) -> None:
        """Called after the last micro-batch's backward, before ``step``."""

    @abc.abstractmethod
    def step(self, lr: float) -> dict[str, float]:
        """Clip, communicate as the strategy does, update; returns scalar metrics (grad_norm...):
        floats or 0-d device tensors, never read on the host here (NCCL: no sync in the step)."""

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.optimizer is None else {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])

    def checkpoint_state(self) -> StateParts:
        """The state to checkpoint, split by who writes it. Tensors are handed over as they live
        (device tensors, views of flat state): the writer copies each to the host as it writes
        it, and nothing may change them until the save returns. Default: all of
        ``state_dict()``, per rank."""
        return StateParts(per_rank=self.state_dict())

    def load_checkpoint_state(self, parts: StateParts, shards: ShardSource | None = None) -> None:
        """Restore from ``checkpoint_state()``'s pieces as saved (``parts.replicated``: rank 0's;
        ``parts.per_rank``: this rank's, or another rank's when the world size changed -- see
        its ``rank``/``world`` entries where a strategy records them); ``shards`` serves the
        owner-sharded state over any flat range. Default: the merged dict to ``load_state_dict``."""
        self.load_state_dict({**parts.replicated, **parts.per_rank})

    def materialize_lazy_state(self) -> None:
        """ACCOUNTING ONLY, meta-device strategies only: allocate, as empty meta tensors, the state
        made lazily in the first step (a torch optimizer's moments; SCAPE overrides it for its
        masks), so ``checkpoint_state()`` has a mid-run checkpoint's shapes. Computes nothing."""
        params = [] if self.optimizer is None else [p for g in self.optimizer.param_groups
                                                    for p in g["params"]]
        if any(p.device.type != "meta" for p in params):
            raise ValueError("materialize_lazy_state runs on meta-device strategies only")
        for p in params:
            p.grad = torch.empty_like(p)
        if self.optimizer is not None:
            self.optimizer.step()       # meta: shapes only
        for p in params:
            p.grad = None

    def close(self) -> None:
        """Release background work (pending async handles, side streams)."""


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's lr, honouring a per-group ``lr_scale``."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def param_groups_with_decay(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: matrices and embeddings decay; biases and 1-D gains (norms) do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
