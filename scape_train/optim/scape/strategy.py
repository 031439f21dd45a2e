"""ScapeStrategy: the trainer's view of SCAPE (no DDP; SCAPE's collectives are the only gradient
communication).

One optimizer step t (``step(lr)``):
  - wait for M_t, the all-gather started at the end of step t-1 (it overlapped forward/backward);
  - lines 1-7 in the engine (replicated §2 or sharded §3);
  - line 8: the owner's top-k of its candidate c^(o) with density d_{t+1}, packed, all-gathered
    asynchronously -- waited on inside step t+1.
At step 1 there is no previous candidate: M_1 is the top-k of step 1's own candidates, gathered
synchronously (all ones, without communication, while the density is 1).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..base import OptimizerStrategy
from ..comm import Comm
from ..config import OptimizerConfig
from ..density import density_at
from .kernels import pack_bits, resolve_backend, unpack_bits
from .masks import MaskExchange, PendingMask, mask_counts, measured_counts, topk_own_mask
from .partition import ParamLayout, build_partition
from .replicated import ReplicatedScape
from .sharded import ShardedScape

_KERNEL_BACKEND = {"auto": "auto", "on": "triton", "off": "torch"}
STATE_VERSION = 1


class ScapeStrategy(OptimizerStrategy):
    def __init__(self, cfg: OptimizerConfig, model: nn.Module, comm: Comm | None = None):
        self.cfg = cfg
        self.comm = comm if comm is not None else Comm()
        self.layout = ParamLayout(model, weight_decay=cfg.weight_decay,
                                  exclude_norm_bias=cfg.exclude_norm_bias)
        self._check_backend()
        self.backend = _KERNEL_BACKEND[cfg.use_triton]
        # Fail now, not at the first step, when Triton is forced where it cannot run.
        resolve_backend(self.backend, torch.empty(0, device=self.layout.device))
        self.part = build_partition(self.layout, self.comm.world, cfg.partitioner)
        self.exchange = MaskExchange(self.part, self.comm, self.layout.total, self.backend,
                                     layout=self.layout, coding=cfg.mask_coding)
        engine_cls = ShardedScape if cfg.sharded else ReplicatedScape
        self.engine = engine_cls(self.layout, self.part, cfg, self.comm, self.backend)
        self.steps_done = 0
        self.mask_cur: torch.Tensor | None = None
        self._pending: PendingMask | None = None
        # ones per segment of a mask at density d, by d: sizes known on the host, not read back
        self._counts: dict[float, list[list[int]]] = {}
        self._loaded_counts: list[list[int]] | None = None   # a mask from another partition

    def _check_backend(self) -> None:
        dev = self.layout.device
        if self.comm.backend == "nccl" and dev.type != "cuda":
            raise ValueError("the nccl backend needs CUDA parameters; move the model to the GPU "
                             "before building the optimizer, or use gloo on CPU")
        if self.comm.backend not in ("none", "gloo", "nccl"):
            raise ValueError(f"SCAPE is tested on gloo and nccl, not {self.comm.backend!r}")

    # -- the trainer's hooks -------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.layout.params:
            p.grad = None

    def density(self, step: int) -> float:
        c = self.cfg
        return density_at(step, c.density, c.density_warmup_steps, c.density_schedule)

    def _flat_grads(self) -> torch.Tensor:
        grads = []
        for name, p in zip(self.layout.names, self.layout.params):
            if p.grad is None:
                raise RuntimeError(f"SCAPE step: parameter {name!r} has no gradient. Every "
                                   "trainable parameter must take part in the loss (or set "
                                   "requires_grad=False before building the optimizer)")
            grads.append(p.grad.reshape(-1).float())
        return torch.cat(grads)

    def counts(self, density: float) -> list[list[int]]:
        if density not in self._counts:
            if len(self._counts) > 64:   # the warm-up visits each density once
                self._counts.clear()
            self._counts[density] = mask_counts(self.part, self.layout, min(density, 1.0))
        return self._counts[density]

    def next_mask(self) -> torch.Tensor | None:
        """M_{t+1} (waits for the all-gather if it is still in flight)."""
        return None if self._pending is None else self._pending.wait()

    @torch.no_grad()
    def step(self, lr: float) -> dict[str, float]:
        t = self.steps_done + 1
        g = self._flat_grads()
        prev = self.mask_cur
        mask = self.next_mask()              # the one wait: M_t, gathered during fwd/bwd
        stat = self.engine.prepare(g, mask)
        if mask is None:                     # first step: build M_1 synchronously
            mask = self._first_mask(stat, self.density(t))
            self.engine.finish_residual(mask)
        counts = self._loaded_counts or self.counts(self.density(t))
        self._loaded_counts = None
        metrics = self.engine.update(mask, lr, t, counts)
        d_next = self.density(t + 1)
        own_bits = topk_own_mask(stat, self.part, self.comm.rank, self.layout, d_next)
        self._pending = self.exchange.start(own_bits, d_next, async_op=True)
        self.mask_cur, self.steps_done = mask, t
        ones = float(sum(map(sum, counts)))
        metrics["scape/density"] = ones / self.layout.total
        metrics["scape/target_density"] = self.density(t)
        if prev is not None:  # temporal stability: ones of M_t that were already in M_{t-1}
            metrics["scape/mask_overlap"] = torch.count_nonzero(mask & prev) / max(ones, 1.0)
        return metrics

    def _first_mask(self, stat: torch.Tensor, density: float) -> torch.Tensor:
        if density >= 1.0:
            return torch.ones(self.layout.total, dtype=torch.bool, device=self.layout.device)
        bits = topk_own_mask(stat, self.part, self.comm.rank, self.layout, density)
        return self.exchange.start(bits, density, async_op=False).wait()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.wait()

    # -- checkpoint: per parameter, in model space ---------------------------------------------
    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        lay = self.layout
        return {n: flat[lay.offsets[i]:lay.offsets[i + 1]].view_as(p).detach().cpu().clone()
                for i, (n, p) in enumerate(zip(lay.names, lay.params))}

    def _split_mask(self, mask: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
        if mask is None:
            return None
        lay = self.layout
        return {n: pack_bits(mask[lay.offsets[i]:lay.offsets[i + 1]], backend="torch").cpu()
                for i, n in enumerate(lay.names)}

    def _join(self, per_name: dict[str, torch.Tensor], what: str) -> torch.Tensor:
        lay = self.layout
        missing = [n for n in lay.names if n not in per_name]
        if missing:
            raise KeyError(f"SCAPE checkpoint has no {what} for parameters {missing[:5]}")
        parts = []
        for n, p in zip(lay.names, lay.params):
            t = per_name[n]
            if t.numel() != p.numel():
                raise ValueError(f"SCAPE checkpoint: {what} of {n!r} has {t.numel()} elements, "
                                 f"the parameter {p.numel()}")
            parts.append(t.reshape(-1).to(device=lay.device, dtype=torch.float32))
        return torch.cat(parts)

    def _join_mask(self, per_name: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        if per_name is None:
            return None
        lay = self.layout
        return torch.cat([unpack_bits(per_name[n].to(lay.device), p.numel(), backend="torch")
                          for n, p in zip(lay.names, lay.params)])

    def state_dict(self) -> dict[str, Any]:
        full = self.engine.full_state()
        state: dict[str, Any] = {
            "version": STATE_VERSION, "mode": self.engine.mode, "step": self.steps_done,
            "rank": self.comm.rank, "world": self.comm.world, "partitioner": self.cfg.partitioner,
            "momentum": self._split(full["momentum"]),
            "residual": self._split(full["residual"]),
            "mask_cur": self._split_mask(self.mask_cur),
            "mask_next": self._split_mask(self.next_mask()),
        }
        if "shared_residual" in full:
            state["shared_residual"] = self._split(full["shared_residual"])
        wire = self._wire_state(full)
        if wire is not None:
            state["wire"] = wire
        return state

    # -- wire-format state (kept apart so that checkpoint-layout changes merge cleanly) ---------
    def _wire_state(self, full: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        """What the wire format adds to the state: the sharded owners' parameter-update residual
        of a low-precision payload (per parameter). Mask codings add nothing: they are lossless
        and need no previous mask beyond ``mask_cur``."""
        if "update_residual" not in full:
            return None
        return {"payload_dtype": self.cfg.payload_dtype,
                "update_residual": self._split(full["update_residual"])}

    def _load_wire_state(self, state: dict[str, Any]) -> None:
        wire = state.get("wire")
        flat = None
        if wire is not None and wire.get("update_residual") is not None:
            flat = self._join(wire["update_residual"], "update residual")
        if isinstance(self.engine, ShardedScape):
            self.engine.load_update_residual(flat)
        elif flat is not None:
            warnings.warn("SCAPE checkpoint holds a sharded low-precision parameter-update "
                          "residual; replicated mode sends exact updates, it is dropped")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported SCAPE state version {state.get('version')!r}")
        momentum = self._join(state["momentum"], "momentum")
        shared = (self._join(state["shared_residual"], "shared residual")
                  if state.get("shared_residual") is not None else None)
        residual = None
        if state["world"] == self.comm.world and state["rank"] == self.comm.rank:
            residual = self._join(state["residual"], "residual")
        else:
            warnings.warn(f"SCAPE checkpoint was written by rank {state['rank']} of "
                          f"{state['world']}; this is rank {self.comm.rank} of {self.comm.world}: "
                          "per-rank residuals are reset to zero (momentum and masks are kept)")
        self.engine.load_full_state(momentum, shared, residual)
        self._load_wire_state(state)
        self.steps_done = int(state["step"])
        self.mask_cur = self._join_mask(state.get("mask_cur"))
        nxt = self._join_mask(state.get("mask_next"))
        self._pending = None if nxt is None else PendingMask.ready(nxt, self.exchange)
        # A mask built under another partition (world size, partitioner) has other per-segment
        # counts than the schedule gives here: read them once, now, not in the step.
        same = state["world"] == self.comm.world and state.get("partitioner",
                                                                 self.cfg.partitioner) == self.cfg.partitioner
        self._loaded_counts = None if nxt is None or same else measured_counts(nxt, self.part)
