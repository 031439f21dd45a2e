"""SCAPE across torchft replica groups: ``strategy=data_parallel`` with
``strategy.elastic.enabled=true`` and ``optimizer=scape``. Every step is a round.

Each worker is one process and one replica group (``scape_train/elastic``), and runs replicated
SCAPE (spec §2) with the quorum as its ranks: its own residual, the momentum and the masks the
same on every worker. A step:

    quorum          at the step's start (the trainer: ``ReplicaGroup.begin_round``); a worker
                    behind heals here from a live peer (below)
    owners          the partition follows the quorum: rank r of Q owns the r-th of Q parts
                    (:meth:`ScapeStrategy.repartition` when Q changed)
    kept            θ, p.grad, m and e are copied aside (the rollback copy)
    step            SCAPE's step on p.grad / a (a: the attempts since the last committed step):
                    the payload's all-reduce (low precision: an all-gather of every worker's
                    coded payload, ``payload.all_gather_mean``) and the next mask's all-gather,
                    through torchft's manager and finished inside the step
    vote            ``Comm.commit``: the quorum's collectives held on this worker
    not committed   nobody applied it: θ, m, e, the masks and the step count go back to the
                    copy, and p.grad keeps the sum of the failed steps' gradients, so the next
                    backward adds to it (as a micro-batch does) and the next attempt divides by a

The committed steps (``progress``) are SCAPE's step count, which indexes the density schedule;
the trainer's step counts attempts, so a failed step moves the lr schedule on by one.

Healing. A worker behind the quorum takes a live peer's model, momentum, masks and step; its
residual restarts at zero. Its own residual (in memory, or in its checkpoint) belongs to an
older point than the quorum's, and part of it may have been sent since (a restarted worker's
checkpoint is older than its last committed step): zero loses its unsent mass once rather than
sending some twice. A worker restarted from its own checkpoint, with nobody ahead to heal from,
keeps that checkpoint's residual.

Refused (``validate``): the sharded mode (it needs the reduce-scatter, which torchft's replica
groups do not carry), and residuals in host memory (the rollback copy is on the device).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scape_train.comm import Comm
from ..base import OptimizerStrategy
from ..config import OptimizerConfig
from ..state import ShardSource, StateParts
from .strategy import ScapeStrategy


def validate_elastic_scape(cfg: OptimizerConfig) -> None:
    """What SCAPE across replica groups cannot run (the module docstring)."""
    refused = {"optimizer.sharded=true": cfg.sharded,
               "optimizer.offload_residuals=true": cfg.offload_residuals}
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise ValueError(f"SCAPE across torchft replica groups runs replicated with the "
                         f"residual on the device; {', '.join(bad)} is not offered there (the "
                         "sharded step needs the reduce-scatter that replica groups do not "
                         "carry): drop it, or train without strategy.elastic")


class ElasticScapeStrategy(OptimizerStrategy):
    synchronous = False    # the trainer's steps are attempts; ``progress`` the committed ones

    def __init__(self, cfg: OptimizerConfig, model: nn.Module, comm: Comm, worker: int,
                 total_steps: int = 0):
        validate_elastic_scape(cfg)
        self.scape = ScapeStrategy(cfg, model, comm, total_steps=total_steps)
        self.comm, self.worker = comm, worker
        self.params = self.scape.layout.params
        self.grad_buffer = self.scape.grad_buffer    # p.grad as views of one flat buffer, or None
        self.attempts = 0          # steps since the last committed one, this one included
        self._keep_grads = False
        # the rollback copy, allocated once: θ and p.grad as the parameters are, m and e fp32
        self._theta = [torch.empty_like(p) for p in self.params]
        self._grads = [torch.empty_like(p) for p in self.params]
        self._m = torch.empty_like(self.scape.reference.state.m)
        self._e = torch.empty_like(self._m)

    def progress(self, step: int) -> int:
        return self.scape.steps_done

    @torch.no_grad()
    def step(self, lr: float) -> dict[str, float]:
        self.attempts += 1
        scape = self.scape
        if scape.part.world != self.comm.world:     # the quorum changed size: new owners
            scape.repartition(self.comm.world)
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            return scape.step(lr)                   # its message names the parameter
        kept = self._keep(grads)
        if self.attempts > 1:
            torch._foreach_div_(grads, float(self.attempts))
        metrics = scape.step(lr)
        self._keep_grads = not self.comm.commit()
        if self._keep_grads:
            self._restore(grads, kept)
            return {}
        self.attempts = 0
        return metrics

    def _keep(self, grads: list[torch.Tensor]) -> tuple:
        """Copy aside what a step changes (θ, p.grad, m, e); return SCAPE's marks."""
        state = self.scape.reference.state
        torch._foreach_copy_(self._theta, self.params)
        torch._foreach_copy_(self._grads, grads)
        self._m.copy_(state.m)
        self._e.copy_(state.residual.tensor())
        return self.scape.marks()

    def _restore(self, grads: list[torch.Tensor], marks: tuple) -> None:
        state = self.scape.reference.state
        torch._foreach_copy_(self.params, self._theta)
        torch._foreach_copy_(grads, self._grads)
        state.m.copy_(self._m)
        state.residual.load(self._e)
        self.scape.rewind(marks)

    def zero_grad(self) -> None:
        if not self._keep_grads:     # a failed step's gradient joins the next one
            self.scape.zero_grad()

    def close(self) -> None:
        self.scape.close()

    # -- state ---------------------------------------------------------------------------------
    def checkpoint_state(self) -> StateParts:
        """SCAPE's state (taken where a step committed, so no failed step is in it) and the
        worker it belongs to: a checkpoint, or a healing peer's copy."""
        parts = self.scape.checkpoint_state()
        return StateParts(replicated=parts.replicated,
                          per_rank={**parts.per_rank, "worker": self.worker})

    def state_dict(self) -> dict[str, Any]:
        return {**self.scape.state_dict(), "worker": self.worker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_checkpoint_state(StateParts(per_rank=state))

    def load_checkpoint_state(self, parts: StateParts, shards: ShardSource | None = None) -> None:
        """This worker's own checkpoint (its residual with it), or a live peer's state while
        healing (the residual restarts at zero: the module docstring)."""
        own = parts.per_rank.get("worker") == self.worker
        self.scape.load_peer_state(parts, residual="state" if own else "zero")
        self.attempts, self._keep_grads = 0, False
        self.scape.zero_grad()
