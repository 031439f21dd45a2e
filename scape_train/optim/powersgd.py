"""DDP + torch's PowerSGD comm hook (low-rank gradient compression with error feedback).

torch's ``powerSGD_hook`` issues its own ``dist.all_reduce`` calls (uncompressed tensors, then the
P factors, then the Q factors), so they cannot pass through :class:`Comm`. The wrapper below counts
them into ``comm`` (kind ``grad``) with the hook's own rule -- a tensor is compressed when
``(rows + cols)·r·min_compression_rate < rows·cols``, ``r = min(rows, cols, rank)`` -- and the
ring all-reduce formula; tests check the counted P/Q sizes against the hook's real buffers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_train.comm import Comm, ring_all_reduce_bytes
from .config import OptimizerConfig
from .dense import DenseStrategy
from .state import StateParts


def powersgd_sizes(shapes: list[torch.Size], rank: int, min_compression_rate: float
                   ) -> tuple[int, int, int]:
    """Elements all-reduced for one bucket once compression is on: (uncompressed, P, Q)."""
    unc = p = q = 0
    for shape in shapes:
        rows = shape[0] if len(shape) else 1
        cols = 1
        for s in shape[1:]:
            cols *= s
        r = min(rows, cols, rank)
        if (rows + cols) * r * min_compression_rate < rows * cols:
            p += rows * r
            q += cols * r
        else:
            unc += rows * cols
    return unc, p, q


def _count(comm: Comm, nbytes: int) -> None:
    # The hook's collectives bypass Comm; record them in its per-kind stats.
    n = ring_all_reduce_bytes(nbytes, comm.world)
    comm.count("grad", n, n)


def counted_powersgd_hook(state, bucket):
    """``state`` = (PowerSGDState, Comm). No annotations: DDP checks them as real classes."""
    ps, comm = state
    buf = bucket.buffer()
    esz = buf.element_size()
    if ps.iter < ps.start_powerSGD_iter:
        _count(comm, buf.numel() * esz)            # vanilla all-reduce of the whole bucket
    else:
        unc, p, q = powersgd_sizes([g.shape for g in bucket.gradients()],
                                   ps.matrix_approximation_rank, ps.min_compression_rate)
        for n in (unc, p, q):
            _count(comm, n * esz)
    return psgd.powerSGD_hook(ps, bucket)


class PowerSGDStrategy(DenseStrategy):
    """Dense AdamW whose DDP gradient all-reduce is PowerSGD-compressed."""

    def __init__(self, cfg: OptimizerConfig, model: nn.Module, comm: Comm | None = None):
        super().__init__(cfg, model, comm, adams=False)
        self.ps_state: psgd.PowerSGDState | None = None
        self._saved_ps: dict[str, Any] | None = None   # loaded before wrap_model: applied there

    def _ddp_kwargs(self, model: nn.Module) -> dict[str, Any]:
        # torch's hook issues the P and Q all-reduces from future callbacks; with several buckets
        # on gloo those callbacks race across ranks and the collectives mismatch (seen at step 5
        # on 4 ranks). One bucket keeps one ordered chain of collectives per step on gloo.
        kwargs = super()._ddp_kwargs(model)
        if self.comm.backend == "gloo":
            total_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
            kwargs["bucket_cap_mb"] = total_mb + 1.0
        return kwargs

    def _register_hook(self, ddp: DDP) -> None:
        self.ps_state = psgd.PowerSGDState(
            process_group=self.comm.group, matrix_approximation_rank=self.cfg.powersgd_rank,
            start_powerSGD_iter=self.cfg.powersgd_start_iter, use_error_feedback=True,
            warm_start=True)
        ddp.register_comm_hook((self.ps_state, self.comm), counted_powersgd_hook)
        if self._saved_ps is not None:
            self._apply_saved(self._saved_ps)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if self.ps_state is not None:
            s = self.ps_state
            out["powersgd"] = {"iter": s.iter, "rank": self.comm.rank, "world": self.comm.world,
                               "error_dict": dict(s.error_dict),
                               "p_memory_dict": dict(s.p_memory_dict),
                               "q_memory_dict": dict(s.q_memory_dict)}
        return out

    def checkpoint_state(self) -> StateParts:
        # The optimizer state is replicated (DDP); the hook's error feedback is each rank's own.
        parts = super().checkpoint_state()
        own = self.state_dict()
        if "powersgd" in own:
            parts.per_rank["powersgd"] = own["powersgd"]
        return parts

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state.get("powersgd")
        if saved is not None:
            self._saved_ps = saved
            if self.ps_state is not None:
                self._apply_saved(saved)

    def _apply_saved(self, saved: dict[str, Any]) -> None:
        assert self.ps_state is not None
        self.ps_state.iter = int(saved["iter"])
        if saved["rank"] == self.comm.rank and saved["world"] == self.comm.world:
            self.ps_state.error_dict = dict(saved["error_dict"])
            self.ps_state.p_memory_dict = dict(saved["p_memory_dict"])
            self.ps_state.q_memory_dict = dict(saved["q_memory_dict"])
