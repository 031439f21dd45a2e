"""Raw-gradient top-k with error feedback feeding AdamW (DGC-like baseline, spec §5).

Per step, on each rank: ``a = g + e``; keep the top-k of ``|a|`` per tensor (1-D tensors whole
when ``exclude_norm_bias``), ``e ← a`` off the selection. Every rank's (indices, values) travel in
ONE all-gather (kind ``payload``; indices bit-cast into the float buffer), the average of all
ranks' sparse vectors becomes the gradient, then clipping and AdamW as usual. Unlike SCAPE, each
rank picks its own indices, so the union fills in as ranks are added, and the sparsified quantity
is the raw gradient -- the setting the paper reports as unstable at high sparsity.

Logged like SCAPE's (for the paper's temporal-stability comparison): ``topk/residual_norm`` (this
rank's ``‖e‖``) and ``topk/mask_overlap``, the fraction of this rank's kept entries at step t that
were also kept at step t-1 -- both 0-d device tensors, read only at log steps (no host sync).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import OptimizerStrategy, set_lr
from scape_train.comm import Comm
from .config import OptimizerConfig
from .dense import build_local_optimizer, grad_norm_and_clip, load_named_state_dict, named_state_dict
from .density import DensitySchedule, segment_k
from .state import StateParts


class TopKAdamWStrategy(OptimizerStrategy):
    def __init__(self, cfg: OptimizerConfig, model: nn.Module, comm: Comm | None = None,
                 total_steps: int = 0):
        self.cfg, self.comm = cfg, comm if comm is not None else Comm()
        self.schedule = DensitySchedule.of(cfg, total_steps)
        self.optimizer, self._names = build_local_optimizer(cfg, model, adams=False)
        named = dict(model.named_parameters())
        self.names = [self._names[i] for i in range(len(self._names))]
        self.params = [named[n] for n in self.names]
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        total = self.offsets[-1]
        if total >= 2 ** 31:
            raise ValueError("topk_adamw packs int32 indices: more than 2^31 parameters")
        self.residual = torch.zeros(total, dtype=torch.float32, device=self.params[0].device)
        self.steps_done = 0
        # this rank's previous selection as a bitmap (mask overlap); None until a step ran here
        self._prev_mask: torch.Tensor | None = None

    def _select(self, acc: torch.Tensor, density: float) -> torch.Tensor:
        """Flat indices (int64) of the kept entries, per tensor."""
        picks = []
        for i, p in enumerate(self.params):
            a, b = self.offsets[i], self.offsets[i + 1]
            k = segment_k(b - a, density)
            if (self.cfg.exclude_norm_bias and p.ndim < 2) or k >= b - a:
                picks.append(torch.arange(a, b, device=acc.device))
            else:
                picks.append(torch.topk(acc[a:b].abs(), k, sorted=False).indices + a)
        return torch.cat(picks)

    @torch.no_grad()
    def step(self, lr: float) -> dict[str, float]:
        t = self.steps_done + 1
        grads = []
        for n, p in zip(self.names, self.params):
            if p.grad is None:
                raise RuntimeError(f"topk_adamw step: parameter {n!r} has no gradient")
            grads.append(p.grad.reshape(-1).float())
        acc = torch.cat(grads).add_(self.residual)
        c = self.cfg
        idx = self._select(acc, self.schedule.at(t))
        vals = acc[idx]
        self.residual.copy_(acc).index_fill_(0, idx, 0.0)
        k = idx.numel()  # the same on every rank: k depends only on shapes and the step
        send = torch.cat([vals, idx.to(torch.int32).view(torch.float32)])
        out = torch.empty(send.numel() * self.comm.world, dtype=torch.float32, device=send.device)
        self.comm.all_gather(out, send, kind="payload")
        dense = torch.zeros_like(acc)
        for r in range(self.comm.world):
            piece = out[r * 2 * k:(r + 1) * 2 * k]
            dense.index_add_(0, piece[k:].view(torch.int32).long(), piece[:k])
        dense.div_(self.comm.world)
        for i, p in enumerate(self.params):
            p.grad = dense[self.offsets[i]:self.offsets[i + 1]].view_as(p).clone()
        set_lr(self.optimizer, lr)
        norm = grad_norm_and_clip(self.params, c.clip_grad, c.foreach)
        self.optimizer.step()
        self.steps_done = t
        metrics = {"grad_norm": norm, "topk/payload_numel": float(k),
                   "topk/residual_norm": self.residual.norm()}
        # temporal stability, as SCAPE computes it: kept entries of step t already kept at t-1
        if self._prev_mask is None:
            self._prev_mask = torch.zeros(acc.numel(), dtype=torch.bool, device=acc.device)
        else:
            metrics["topk/mask_overlap"] = torch.count_nonzero(self._prev_mask[idx]) / max(k, 1)
            self._prev_mask.zero_()
        self._prev_mask.index_fill_(0, idx, True)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": named_state_dict(self.optimizer, self._names), "step": self.steps_done,
                "rank": self.comm.rank, "world": self.comm.world,
                "residual": {n: self.residual[self.offsets[i]:self.offsets[i + 1]].cpu().clone()
                             for i, n in enumerate(self.names)}}

    def checkpoint_state(self) -> StateParts:
        # The averaged sparse gradient is the same on every rank, so is the AdamW state; the
        # error-feedback residual is each rank's own (views: written as one storage).
        return StateParts(
            replicated={"optimizer": named_state_dict(self.optimizer, self._names),
                        "step": self.steps_done},
            per_rank={"rank": self.comm.rank, "world": self.comm.world,
                      "residual": {n: self.residual[self.offsets[i]:self.offsets[i + 1]]
                                   for i, n in enumerate(self.names)}})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_named_state_dict(self.optimizer, state["optimizer"], self._names)
        self.steps_done = int(state["step"])
        self._prev_mask = None   # the first step after a load has no previous selection here
        if state["rank"] == self.comm.rank and state["world"] == self.comm.world:
            for i, n in enumerate(self.names):
                self.residual[self.offsets[i]:self.offsets[i + 1]].copy_(
                    state["residual"][n].reshape(-1))
        else:
            import warnings
            warnings.warn("topk_adamw checkpoint from another rank/world size: residuals reset")
            self.residual.zero_()
