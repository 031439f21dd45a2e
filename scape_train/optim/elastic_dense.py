"""Dense data parallelism across torchft replica groups: ``strategy=data_parallel`` with
``strategy.elastic.enabled=true`` and optimizer ``adamw`` or ``adams``. Every step is a round.

Each worker is one process and one replica group (``scape_train/elastic``). A step:

    quorum           at the step's start (the trainer: ``ReplicaGroup.begin_round``); a worker
                     behind the quorum's committed step heals here from a live peer
    backward         this worker's batch into p.grad, added to what it holds from failed steps
    g                the mean over the quorum of p.grad / a: one all-reduce of a flat fp32
                     buffer through torchft's manager, where a is this worker's attempts since
                     its last committed step (1 unless a step failed)
    vote             ``Comm.commit``: the quorum's all-reduce held on this worker
    committed        p.grad <- g, then clipping and the optimizer's update, as dense data
                     parallelism takes them (``DenseStrategy.step`` on one process)
    not committed    nobody applied it: the parameters and the optimizer state stay, and p.grad
                     is kept, so the next backward adds to it and the failed step's batch joins
                     the next committed step the way a micro-batch does

The committed steps are the step count every participant agrees on (``progress``): validation,
checkpoints and the run's end follow them, and after each the worker's data cursor is kept
(``ReplicaGroup.end_round``). The trainer's own step counts attempts, so a failed step moves the
lr schedule on by one, as a failed outer round does under local steps. A worker that heals takes
the peer's parameters, optimizer state and counts, and drops what it held from failed steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scape_train.comm import Comm
from .base import OptimizerStrategy
from .config import OptimizerConfig
from .dense import DenseStrategy
from .state import ShardSource, StateParts

DENSE = ("adamw", "adams")      # the optimizers this strategy carries


class ElasticDenseStrategy(OptimizerStrategy):
    synchronous = False         # the trainer's steps are attempts; ``progress`` the committed ones

    def __init__(self, cfg: OptimizerConfig, model: nn.Module, comm: Comm):
        if cfg.name not in DENSE:
            raise ValueError(f"elastic data parallelism carries the dense optimizers {list(DENSE)}, "
                             f"not {cfg.name!r}")
        # the update on one process: no DDP, the gradients are averaged here
        self.inner = DenseStrategy(cfg, model, Comm(), adams=cfg.name == "adams")
        self.optimizer, self.params, self.comm = self.inner.optimizer, self.inner.params, comm
        self.committed_steps = 0
        self.attempts = 0           # steps since the last committed one, this one included
        self._keep_grads = False

    def progress(self, step: int) -> int:
        return self.committed_steps

    def step(self, lr: float) -> dict[str, float]:
        self.attempts += 1
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            if self.attempts > 1:
                flat.div_(self.attempts)
        self.comm.all_reduce(flat, kind="grad", average=True)
        self._keep_grads = not self.comm.commit()
        if self._keep_grads:
            return {}
        with torch.no_grad():
            offset = 0
            for p in self.params:
                view = flat[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = view.to(p.dtype)
                else:
                    p.grad.copy_(view)
                offset += p.numel()
        metrics = self.inner.step(lr)
        self.committed_steps += 1
        self.attempts = 0
        return metrics

    def zero_grad(self) -> None:
        if not self._keep_grads:   # a failed step's gradient joins the next one
            self.inner.zero_grad()

    # -- state ---------------------------------------------------------------------------------
    def checkpoint_state(self) -> StateParts:
        """The optimizer state and the committed count, this worker's own (a checkpoint or a
        healing peer); taken where a step committed, so no failed step's gradient is in it."""
        return StateParts(per_rank={**self.inner.state_dict(),
                                    "committed_steps": self.committed_steps})

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint_state().per_rank

    def load_checkpoint_state(self, parts: StateParts, shards: ShardSource | None = None) -> None:
        state = {**parts.replicated, **parts.per_rank}
        self.inner.load_state_dict(state)
        self.committed_steps = int(state["committed_steps"])
        self.attempts, self._keep_grads = 0, False
        self.inner.zero_grad()
