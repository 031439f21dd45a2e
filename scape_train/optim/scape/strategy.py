"""ScapeStrategy: the trainer's view of SCAPE (no DDP; SCAPE's collectives are the only gradient
communication).

One optimizer step t (``step(lr)``):
  - wait for M_t, the all-gather started at the end of step t-1 (it overlapped forward/backward);
  - lines 1-7 in an engine: the reference (replicated §2 or sharded §3, line by line), which
    owns the state, or the fused O(k) engine on the same state, picked per step;
  - line 8: the owner's top-k of its candidate c^(o) with density d_{t+1}, packed, all-gathered
    asynchronously -- waited on inside step t+1.
At step 1 there is no previous candidate: M_1 is the top-k of step 1's own candidates, gathered
synchronously (all ones, without communication, while the density is 1).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
from torch import nn

from ..base import OptimizerStrategy
from scape_train.comm import Comm
from ..config import OptimizerConfig
from ..density import DensitySchedule
from ..grad_buffer import FlatGradBuffer
from ..state import FlatShard, ShardSource, StateParts
from .kernels import pack_bits, triton_available, unpack_bits
from .masks import (Mask, MaskExchange, PendingMask, mask_counts, measured_counts, overlap,
                    own_segments, topk_own_mask)
from .partition import ParamLayout, build_partition
from .fused import FusedReplicatedScape, FusedShardedScape, fuses
from .replicated import ReplicatedScape
from .sharded import ShardedScape
from .torch_passes import TorchPasses

STATE_VERSION = 1
_triton_passes: dict[str, Any] = {}


def select_passes(use_triton: str, device: torch.device):
    """SCAPE's passes for tensors on ``device`` (``optimizer.use_triton``: auto, on or off): the
    Triton kernels (:class:`.triton_passes.TritonPasses`, one per device) on CUDA where triton
    imports, else the torch ops (:class:`.torch_passes.TorchPasses`), also the oracle the
    kernels are tested against. ``on`` fails here when Triton cannot run (on CPU tensors it
    needs ``TRITON_INTERPRET=1`` set before triton is first imported: how tests run it)."""
    device = torch.device(device)
    if use_triton not in ("auto", "on", "off"):
        raise ValueError(f"use_triton must be auto, on or off, got {use_triton!r}")
    if use_triton == "off" or (use_triton == "auto"
                               and (device.type != "cuda" or not triton_available())):
        return TorchPasses()
    if not triton_available():
        raise RuntimeError("optimizer.use_triton=on but triton cannot be imported; install "
                           "triton (Linux) or set optimizer.use_triton=off")
    interpreted = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")
    if device.type != "cuda" and not interpreted:
        raise RuntimeError("optimizer.use_triton=on with the model on the CPU needs "
                           "TRITON_INTERPRET=1 set before triton is first imported; set "
                           "optimizer.use_triton=off (or auto) on the CPU")
    if str(device) not in _triton_passes:
        from .triton_passes import TritonPasses   # imports triton: only when chosen

        _triton_passes[str(device)] = TritonPasses(device)
    return _triton_passes[str(device)]


class ScapeStrategy(OptimizerStrategy):
    def __init__(self, cfg: OptimizerConfig, model: nn.Module, comm: Comm | None = None,
                 total_steps: int = 0):
        self.cfg = cfg
        self.schedule = DensitySchedule.of(cfg, total_steps)
        self.comm = comm if comm is not None else Comm()
        self.layout = ParamLayout(model, weight_decay=cfg.weight_decay,
                                  exclude_norm_bias=cfg.exclude_norm_bias)
        self._check_backend()
        # the kernels, chosen once (the masks' codecs and the fused step's passes); fails now,
        # not at the first step, when Triton is forced where it cannot run
        self.passes = select_passes(cfg.use_triton, self.layout.device)
        self._set_owners(self.comm.world)
        reference, fused = ((ShardedScape, FusedShardedScape) if cfg.sharded
                            else (ReplicatedScape, FusedReplicatedScape))
        args = (self.layout, self.part, cfg, self.comm)
        self.reference = reference(*args)
        # the O(k) engine, where the configuration allows it (fuses); it works on the
        # reference's state, and a step at a density it does not accept runs the reference
        self.fused = (fused(self.reference.state, *args, lib=self.passes)
                      if cfg.scape_impl == "fused" and fuses(cfg.offload_residuals) else None)
        self.last_engine = self.reference     # the engine of the last step
        # p.grad as views of one flat buffer (optimizer.flat_grads): both paths read it in place
        self.grad_buffer = (FlatGradBuffer(self.layout.names, self.layout.params, "SCAPE step")
                            if cfg.flat_grads else None)
        self.steps_done = 0
        self._cur: Mask | None = None    # the last step's M_t (its indices, where decoded)
        self._pending: PendingMask | None = None
        # ones per segment of a mask at density d, by d: sizes known on the host, not read back
        self._counts: dict[float, list[list[int]]] = {}
        self._segments: dict[float, tuple] = {}      # this owner's top-k segments, by d
        self._loaded_counts: list[list[int]] | None = None   # a mask from another partition

    def _check_backend(self) -> None:
        dev = self.layout.device
        if self.comm.backend == "nccl" and dev.type != "cuda":
            raise ValueError("the nccl backend needs CUDA parameters; move the model to the GPU "
                             "before building the optimizer, or use gloo on CPU")
        if self.comm.backend not in ("none", "gloo", "nccl", "torchft"):
            raise ValueError(f"SCAPE is tested on gloo and nccl, not {self.comm.backend!r}")

    def _set_owners(self, world: int) -> None:
        """The partition over ``world`` owners and the mask exchange that follows it."""
        self.part = build_partition(self.layout, world, self.cfg.partitioner)
        self.exchange = MaskExchange(self.part, self.comm, self.layout.total, self.passes,
                                     layout=self.layout, coding=self.cfg.mask_coding)

    def repartition(self, world: int) -> None:
        """Owners for a world of ``world`` ranks (elastic runs: the quorum's size, which changes
        between steps; ``optim/scape/elastic.py``): the partition, the mask exchange and the
        engines' view of it. The next mask, built under the old owners, keeps its ones; its
        count per new segment is read from the device once (``measured_counts``)."""
        self._set_owners(world)
        for engine in (self.reference, self.fused):
            if engine is not None:
                engine.part = self.part
        if self.fused is not None:
            self.fused.forget_support()
            self.fused.drop_plans()
        self._counts.clear()
        self._segments.clear()
        nxt = self._next()
        self._loaded_counts = None if nxt is None else measured_counts(nxt.dense(keep=False),
                                                                        self.part)

    def marks(self) -> tuple:
        """What a step moves beyond the tensors it writes in place (the masks, the step count,
        a loaded mask's counts): for :meth:`rewind` (elastic runs: a step nobody committed)."""
        return self._cur, self._pending, self.steps_done, self._loaded_counts

    def rewind(self, marks: tuple) -> None:
        """Back to :meth:`marks`' point; the caller restores θ, m and e. m's support is then the
        earlier one, which the fused engine no longer knows."""
        self._cur, self._pending, self.steps_done, self._loaded_counts = marks
        if self.fused is not None:
            self.fused.forget_support()

    # -- the trainer's hooks -------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
            return
        for p in self.layout.params:
            p.grad = None

    def density(self, step: int) -> float:
        return self.schedule.at(step)

    def _grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient, flattened (views of ``p.grad`` where it is contiguous;
        with the flat buffer, its per-parameter views)."""
        if self.grad_buffer is not None:
            return self.grad_buffer.per_tensor()
        grads = []
        for name, p in zip(self.layout.names, self.layout.params):
            if p.grad is None:
                raise RuntimeError(f"SCAPE step: parameter {name!r} has no gradient. Every "
                                   "trainable parameter must take part in the loss (or set "
                                   "requires_grad=False before building the optimizer)")
            grads.append(p.grad.reshape(-1).float())
        return grads

    def _flat_grads(self) -> torch.Tensor:
        # the buffer itself (the step may consume it: zero_grad refills it), else a fresh copy
        if self.grad_buffer is not None:
            return self.grad_buffer.flat()
        return torch.cat(self._grads())

    def counts(self, density: float) -> list[list[int]]:
        if density not in self._counts:
            if len(self._counts) > 64:   # the warm-up visits each density once
                self._counts.clear()
            self._counts[density] = mask_counts(self.part, self.layout, min(density, 1.0))
        return self._counts[density]

    def _topk(self, stat_own: torch.Tensor, density: float) -> torch.Tensor:
        """This owner's bits of the next mask at ``density``, by the chosen passes (its
        segments' ``k`` kept per density, as :meth:`counts`)."""
        segs = self._segments.get(density)
        if segs is None:
            if len(self._segments) > 64:
                self._segments.clear()
            segs = self._segments[density] = own_segments(self.part, self.comm.rank,
                                                          self.layout, min(density, 1.0))
        return topk_own_mask(stat_own, self.part, self.comm.rank, self.layout, density,
                             self.passes, segs)

    @property
    def mask_cur(self) -> torch.Tensor | None:
        """M_t of the last step as a bool tensor (made from its indices: not kept)."""
        return None if self._cur is None else self._cur.dense(keep=False)

    @mask_cur.setter
    def mask_cur(self, mask: torch.Tensor | None) -> None:
        self._cur = Mask.of(mask)

    def next_mask(self) -> torch.Tensor | None:
        """M_{t+1} as a bool tensor (waits for the all-gather if it is still in flight)."""
        nxt = self._next()
        return None if nxt is None else nxt.dense(keep=False)

    def set_masks(self, cur: torch.Tensor | None, nxt: torch.Tensor | None) -> None:
        """M_t of the last step and M_{t+1}, as bool tensors (a checkpoint's masks)."""
        self.mask_cur = cur
        self._pending = None if nxt is None else PendingMask.ready(nxt, self.exchange)

    def materialize_lazy_state(self) -> None:
        """ACCOUNTING ONLY (meta device): the current and next masks as empty meta tensors; the
        rest of SCAPE's state is allocated at construction."""
        if self.layout.device.type != "meta":
            raise ValueError("materialize_lazy_state runs on meta-device strategies only")
        self.set_masks(torch.empty(self.layout.total, dtype=torch.bool, device="meta"),
                       torch.empty(self.layout.total, dtype=torch.bool, device="meta"))

    def _next(self) -> Mask | None:
        """M_{t+1}, gathered and decoded (waits for the all-gather if it is still in flight)."""
        return None if self._pending is None else self._pending.mask()

    @torch.no_grad()
    def step(self, lr: float) -> dict[str, float]:
        t = self.steps_done + 1
        counts = self._loaded_counts or self.counts(self.density(t))
        self._loaded_counts = None
        # the fused engine at the densities it accepts: it reads the gradients where autograd
        # left them (and consumes them: scaled in place), the reference takes one flat copy
        ones = sum(map(sum, counts))
        engine = self._engine_for(ones)
        g = self._grads() if engine is self.fused else self._flat_grads()
        prev = self._cur
        # the one wait: M_t, gathered during fwd/bwd, decoded to its indices (the fused engines
        # walk them; the reference engines make its bool tensor)
        mask = self._next()
        stat = engine.prepare(g, mask, counts)
        if mask is None:                     # first step: build M_1 synchronously
            mask = self._first_mask(stat, self.density(t))
            engine.finish_residual(mask)
        # M_{t+1}'s top-k reads the candidate only, not the averaged payload: the fused engines
        # run it while the payload's collective is in flight; the others leave it to here
        d_next = self.density(t + 1)
        if self.schedule.dense(t):
            # a dense-phase step is data-parallel AdamS; the mask that starts the sparse phase is
            # the top-k of the averaged momentum m_t (spec §2 line 9, start step), read after
            # the update: every owner holds m_t on its segments
            metrics, _ = engine.update(mask, lr, t, counts)
            own_bits = self._topk(self._own_momentum(), d_next)
        else:
            if self.cfg.mask_hysteresis > 0:
                stat = self._with_hysteresis(stat, mask)
            next_topk = functools.partial(self._topk, stat, d_next)
            # an engine that overlaps runs it during its payload's collective and returns its
            # bits; the others return None and it runs here
            metrics, own_bits = engine.update(mask, lr, t, counts, during_payload=next_topk)
            if own_bits is None:
                own_bits = next_topk()
        self._pending = self.exchange.start(own_bits, d_next, async_op=True)
        metrics.update(engine.finish_step())   # after the top-k has read the candidate
        self._cur, self.steps_done = mask, t
        metrics["scape/density"] = ones / self.layout.total
        metrics["scape/target_density"] = self.density(t)
        if prev is not None:  # temporal stability: ones of M_t that were already in M_{t-1}
            metrics["scape/mask_overlap"] = overlap(mask, prev, self.passes) / max(ones, 1.0)
        mask.keep_one_form()   # one form of M_t between steps: its indices, or its bool tensor
        return metrics

    def _with_hysteresis(self, stat: torch.Tensor, mask: Mask) -> torch.Tensor:
        """Ours, opt-in (``optimizer.mask_hysteresis`` = γ > 0; not in the spec): the next mask's
        statistic is ``|c|·(1+γ)`` where M_t holds a one, ``|c|`` elsewhere, so a coordinate
        leaves the mask only for one larger by a factor. Why: m is zeroed off the mask, and
        AdamS builds its second moment from m, so a coordinate that (re)enters takes a step of
        lr·(1-β1)/√(1-β2) whatever its gradient (0.45·lr at β = (0.9, 0.95)) where one that
        stays takes about lr: fewer swaps, more full steps. A copy (the fused step changes c's
        buffer before the top-k has run)."""
        lo, hi = self.part.ranges[self.comm.rank]
        on_mask = mask.dense(keep=False)[lo:hi]
        return torch.where(on_mask, stat.abs() * (1.0 + self.cfg.mask_hysteresis), stat.abs())

    def keep_intermediates(self, on: bool = True) -> None:
        """Tests: each engine keeps its step's intermediates (candidate, payload, ĝ...) in its
        ``last``; read them from :attr:`last_engine`."""
        for engine in (self.reference, self.fused):
            if engine is not None:
                engine.record = on

    def _engine_for(self, ones: int):
        """The engine of a step whose mask has ``ones`` ones. The reference step does not track
        m's support: after it, the fused engine must read m and e everywhere once."""
        engine = self.fused if self.fused is not None and self.fused.accepts(ones) \
            else self.reference
        if engine is self.reference and self.fused is not None:
            self.fused.forget_support()
        self.last_engine = engine
        return engine

    def _own_momentum(self) -> torch.Tensor:
        """m over this rank's owner range (the engine holds all of it, or that range)."""
        lo, hi = self.part.ranges[self.comm.rank]
        state_lo = self.reference.state_range[0]
        return self.reference.state.m[lo - state_lo:hi - state_lo]

    def _first_mask(self, stat: torch.Tensor, density: float) -> Mask:
        if density >= 1.0:
            return Mask.of(torch.ones(self.layout.total, dtype=torch.bool,
                                      device=self.layout.device))
        bits = self._topk(stat, density)
        return self.exchange.start(bits, density, async_op=False).mask()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.wait()
        if self.grad_buffer is not None:
            self.grad_buffer.close()

    # -- checkpoint: per parameter, in model space ---------------------------------------------
    # ``state_dict()`` is the whole state in one dict (gathered in sharded mode): the in-memory
    # form tests and single processes use. ``checkpoint_state()`` is what checkpoints write: the
    # masks (and the replicated momentum) once, the owner-sharded m and ρ by their owners, the
    # residual by each rank -- live tensors and views, nothing gathered or copied.
    def _split(self, flat: torch.Tensor, copy: bool = True) -> dict[str, torch.Tensor]:
        lay = self.layout
        views = {n: flat[lay.offsets[i]:lay.offsets[i + 1]].view_as(p).detach()
                 for i, (n, p) in enumerate(zip(lay.names, lay.params))}
        return {n: v.cpu().clone() for n, v in views.items()} if copy else views

    def _split_mask(self, mask: torch.Tensor | None, host: bool = True
                    ) -> dict[str, torch.Tensor] | None:
        if mask is None:
            return None
        lay = self.layout
        packed = {n: pack_bits(mask[lay.offsets[i]:lay.offsets[i + 1]])
                  for i, n in enumerate(lay.names)}
        return {n: t.cpu() for n, t in packed.items()} if host else packed

    def _join(self, per_name: dict[str, torch.Tensor], what: str, lo: int = 0,
              hi: int | None = None) -> torch.Tensor:
        """The flat range ``[lo, hi)`` (default: all) of per-parameter tensors, on the device;
        assembled where the tensors are (the host, from a checkpoint), so that only the range
        reaches the device."""
        lay = self.layout
        hi = lay.total if hi is None else hi
        missing = [n for n in lay.names if n not in per_name]
        if missing:
            raise KeyError(f"SCAPE checkpoint has no {what} for parameters {missing[:5]}")
        parts = []
        for i, (n, p) in enumerate(zip(lay.names, lay.params)):
            t = per_name[n]
            if t.numel() != p.numel():
                raise ValueError(f"SCAPE checkpoint: {what} of {n!r} has {t.numel()} elements, "
                                 f"the parameter {p.numel()}")
            a, b = lay.offsets[i], lay.offsets[i + 1]
            s, e = max(lo, a), min(hi, b)
            if s < e:
                parts.append(t.reshape(-1)[s - a:e - a])
        flat = torch.cat(parts) if parts else torch.zeros(0)
        return flat.to(device=lay.device, dtype=torch.float32)

    def _join_mask(self, per_name: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        if per_name is None:
            return None
        lay = self.layout
        return torch.cat([unpack_bits(per_name[n].to(lay.device), p.numel())
                          for n, p in zip(lay.names, lay.params)])

    def _header(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "mode": self.reference.mode, "step": self.steps_done,
                "rank": self.comm.rank, "world": self.comm.world,
                "partitioner": self.cfg.partitioner, "partition_world": self.part.world}

    def state_dict(self) -> dict[str, Any]:
        full = self.reference.full_state()
        state: dict[str, Any] = {
            **self._header(),
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

    def checkpoint_state(self) -> StateParts:
        pieces = self.reference.checkpoint_tensors()
        header = self._header()
        rank = header.pop("rank")
        replicated: dict[str, Any] = {**header,
                                      "mask_cur": self._split_mask(self.mask_cur, host=False),
                                      "mask_next": self._split_mask(self.next_mask(), host=False)}
        replicated.update({k: self._split(v, copy=False) for k, v in pieces["replicated"].items()})
        per_rank: dict[str, Any] = {"rank": rank, "world": self.comm.world}
        per_rank.update({k: self._split(v, copy=False) for k, v in pieces["per_rank"].items()})
        sharded = None
        if pieces["sharded"]:
            lo, hi = self.reference.state_range
            sharded = FlatShard(lo, hi, self.layout.total,
                                {k: v.detach() for k, v in pieces["sharded"].items()})
        return StateParts(replicated=replicated, per_rank=per_rank, sharded=sharded)

    # -- wire-format state (kept apart so that checkpoint-layout changes merge cleanly) ---------
    def _wire_state(self, full: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        """What the wire format adds to the state: the sharded owners' parameter-update residual
        of a low-precision payload (per parameter). Mask codings add nothing: they are lossless
        and need no previous mask beyond ``mask_cur``."""
        if "update_residual" not in full:
            return None
        return {"payload_dtype": self.cfg.payload_dtype,
                "update_residual": self._split(full["update_residual"])}

    def _load_wire_state(self, state: dict[str, Any], shards: ShardSource | None, lo: int,
                         hi: int) -> None:
        """The update residual over this rank's range: per parameter from an in-memory state,
        or from the owners' shards of a checkpoint."""
        owned = self._range_of(state.get("wire") or {}, shards, "update_residual",
                               "update residual", lo, hi)
        if isinstance(self.reference, ShardedScape):
            self.reference.load_update_residual(owned)
        elif owned is not None:
            warnings.warn("SCAPE checkpoint holds a sharded low-precision parameter-update "
                          "residual; replicated mode sends exact updates, it is dropped")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load(state, None)

    def load_checkpoint_state(self, parts: StateParts, shards: ShardSource | None = None) -> None:
        self._load({**parts.replicated, **parts.per_rank}, shards)

    def load_peer_state(self, parts: StateParts, residual: str) -> None:
        """Elastic runs (``optim/scape/elastic.py``): the momentum, masks and step of ``parts``
        whatever rank and world wrote them, and the residual as ``residual`` says: ``state``
        (this worker's own checkpoint) or ``zero`` (another worker's state)."""
        self._load({**parts.replicated, **parts.per_rank}, None, residual=residual)

    def _range_of(self, state: dict[str, Any], shards: ShardSource | None, key: str, what: str,
                  lo: int, hi: int) -> torch.Tensor | None:
        """``key`` over the flat range ``[lo, hi)`` on the device: from the per-parameter
        tensors of a replicated (or in-memory) state, else from the owners' shards."""
        if state.get(key) is not None:
            return self._join(state[key], what, lo, hi)
        if shards is None:
            return None
        t = shards.read(key, lo, hi, self.layout.total)
        return None if t is None else t.to(device=self.layout.device, dtype=torch.float32)

    def _load(self, state: dict[str, Any], shards: ShardSource | None,
              residual: str = "rank") -> None:
        """``residual``: ``rank`` takes the state's residual where this rank of this world wrote
        it, else zero (with a warning); ``state`` takes it; ``zero`` resets it."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported SCAPE state version {state.get('version')!r}")
        lo, hi = self.reference.state_range    # all of it (replicated) or the owned range (sharded)
        momentum = self._range_of(state, shards, "momentum", "momentum", lo, hi)
        if momentum is None:
            raise KeyError("SCAPE checkpoint holds no momentum (neither per parameter nor sharded)")
        shared = self._range_of(state, shards, "shared_residual", "shared residual", lo, hi)
        own = residual == "state" or (residual == "rank" and state["world"] == self.comm.world
                                       and state["rank"] == self.comm.rank)
        if not own and residual == "rank":
            warnings.warn(f"SCAPE checkpoint was written by rank {state['rank']} of "
                          f"{state['world']}; this is rank {self.comm.rank} of {self.comm.world}: "
                          "per-rank residuals are reset to zero (momentum and masks are kept)")
        self.reference.load_range_state(momentum, shared,
                                        self._join(state["residual"], "residual") if own else None)
        if self.fused is not None:
            self.fused.forget_support()
        self._load_wire_state(state, shards, lo, hi)
        self.steps_done = int(state["step"])
        nxt = self._join_mask(state.get("mask_next"))
        self.set_masks(self._join_mask(state.get("mask_cur")), nxt)
        # A mask built under another partition (world size, partitioner) has other per-segment
        # counts than the schedule gives here: read them once, now, not in the step.
        same = (state.get("partition_world", state["world"]) == self.part.world
                and state.get("partitioner", self.cfg.partitioner) == self.cfg.partitioner)
        self._loaded_counts = None if nxt is None or same else measured_counts(nxt, self.part)
