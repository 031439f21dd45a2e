"""SCAPE's fast local step (``optimizer.scape_impl: fused``): the same equations as the reference
engines (:mod:`.replicated`, :mod:`.sharded`), with the work proportional to the mask where the
spec allows it.

What makes it O(k) instead of O(numel):
  - ``m`` is nonzero only on the previous mask (``m_t = M_t ⊙ b̄``). The engine keeps that mask's
    flat indices ``pidx``: ``β1·m`` contributes to the candidate only there (a k-sized fix-up),
    and ``m`` is zeroed off the new mask by zeroing ``m[pidx]``, not by a full ``masked_fill``.
  - The residual buffer itself becomes the candidate: ``e ← e + (1-β1)·g`` (the gradient buffer
    scaled in place), ``e[pidx] ← β1·m[pidx] + (1-β1)·g[pidx]`` (there ``e_{t-1} = 0``). The
    payload is ``e[idx]``; after the owner's top-k has read ``e`` on its range, ``e[idx] ← 0``
    leaves ``e_t = (1-M)⊙c``. No separate ``c``, no full-size ``ĝ``.
  - AdamS runs on the k gathered values; off the mask the parameters only get weight decay. The
    old momentum at the mask is stored by the ĝ pass, which reads it anyway, so AdamS reads it
    contiguously instead of gathering it again.

Values: the same elementwise ops in the same order as the reference on every coordinate (the
off-mask candidate is ``round((1-β1)·g) + e``, as the reference's ``β1·0 + (1-β1)·g`` then
``+ e``), so results agree bit for bit wherever torch's CPU kernels round alike; the known
differences are ≤ 1 ulp per op: a vectorized ``add(alpha=)``/``addcmul`` may use an FMA in the
body of a tensor and a separate multiply-add in its scalar tail (the k-sized gathered tensors put
other coordinates in the tail), and ‖ĝ‖ comes from a float64 sum of squares.

The passes behind one interface, chosen once (:func:`.strategy.select_passes`): the Triton
kernels on CUDA (:mod:`.triton_passes`) or torch ops (:mod:`.torch_passes`: the CPU,
``use_triton=off``, and a low-precision payload, whose parameter sync adds decoded updates rather
than writing new values); both take tensors, :mod:`.passes`' segments and AdamS constants, and
return their sums of squares on the device (the residual-norm and ĝ-norm metrics), so nothing is
read back to the host. The engines work on the reference engine's state
(:class:`.state.ScapeState`); the strategy runs the reference engine instead for what they do not
cover (:func:`fuses`: offloaded residuals, walked in host chunks) and for steps at a density where
the full-size passes are cheaper (:meth:`_FusedEngine.accepts`).
"""

from __future__ import annotations

import torch

from scape_train.comm import Comm
from ..adams_constants import AdamSConstants
from ..config import OptimizerConfig
from . import passes
from .masks import Mask
from .partition import ParamLayout, PartitionMap
from .payload import PayloadCodec, all_gather_rows, quantized_mean, reduce_scatter_mean
from .passes import clip_coef
from .state import ScapeState
from .torch_passes import TorchPasses


# The fused path runs while the mask holds at most this fraction of the parameters (SCAPE's
# densities are 0.01-0.1, plus the always-sent norm and bias tensors; a density warm-up starts
# at 1): see _FusedEngine.accepts.
FUSED_MAX_FRACTION = 0.5


def _overlapped(handle, work):
    """Run ``work`` (if any) while the collective behind ``handle`` is in flight, then wait;
    returns what ``work`` returned."""
    done = None if work is None else work()
    handle.wait()
    return done


def _root(sq: torch.Tensor, cut=None) -> torch.Tensor:
    """``sqrt(max(sq - cut, 0))``: a norm from a pass's sum of squares, on the device (no
    ``cut``: a sum of squares, never negative, has its root taken as it is)."""
    return sq.sqrt() if cut is None else (sq - cut).clamp_min(0.0).sqrt()


def _gathered_at(a: int, starts: list[int], counts: list[int], width: int) -> int:
    """Where index-list entry ``a`` sits in the parameter all-gather: owners' shards are
    ``width`` apart, owner r's values start at its ``starts[r]``-th index."""
    r = max(q for q in range(len(starts)) if starts[q] <= a and counts[q])
    return r * width + a - starts[r]


class _Plan:
    """A mask's index list cut by the partition's segments, from the host-known counts:
    ``segs``: ``(tensor, a, b)`` of each segment's slice ``[a, b)`` of the list; ``spans``: its
    elements ``(s0, s1)`` in its tensor. A segment without ones (a mask measured from a
    checkpoint of another world size can leave one so) has an empty slice: the passes still
    decay its parameters."""

    def __init__(self, part: PartitionMap, layout: ParamLayout, counts: list[list[int]]):
        self.segs, self.spans = [], []
        self.param_segs: dict[tuple, list] = {}     # _FusedEngine._segments, built once
        at = 0
        for rank_segs, rank_counts in zip(part.segments, counts):
            for seg, k in zip(rank_segs, rank_counts):
                if seg.numel:
                    s0 = seg.flat_start - layout.offsets[seg.tensor]
                    self.segs.append((seg.tensor, at, at + k))
                    self.spans.append((s0, s0 + seg.numel))
                at += k


def fuses(offload_residuals: bool) -> bool:
    """Whether a configuration can take the O(k) step at all: not with an offloaded residual
    (walked in host chunks by the reference)."""
    return not offload_residuals


class _FusedEngine:
    """Shared by both fused engines: index plans, the passes' segments, the support of m.
    The engine works on the reference engine's :class:`ScapeState`; what it adds is m's
    support (the previous mask's indices), which the reference step does not track: the
    strategy calls :meth:`forget_support` whenever the state changes under another path."""

    def __init__(self, state: ScapeState, layout: ParamLayout, part: PartitionMap,
                 cfg: OptimizerConfig, comm: Comm, lib=None):
        assert fuses(cfg.offload_residuals)
        self.state, self.layout, self.part, self.cfg, self.comm = state, layout, part, cfg, comm
        self.codec = PayloadCodec(cfg.payload_dtype)
        self.record = False          # tests: keep this step's intermediates in ``last``
        self.last: dict[str, torch.Tensor] = {}
        # the passes (strategy.select_passes): chosen once; the torch ones serve what the
        # Triton kernels do not take
        self._lib = lib or TorchPasses()
        self._torch = self._lib if isinstance(self._lib, TorchPasses) else TorchPasses()
        self._pidx: torch.Tensor | None = None      # previous mask's indices (m's support)
        self._prev: _Plan | None = None             # ... and its plan
        self._plans: dict[tuple, _Plan] = {}

    def accepts(self, k: int) -> bool:
        """Whether a step whose mask has ``k`` ones is cheaper here: the index-gathered
        temporaries (int64 indices, k-sized copies) cost ~12 words per one, more memory and time
        than the reference's full-size passes once k nears numel -- the dense start of a density
        warm-up."""
        return k <= FUSED_MAX_FRACTION * self.layout.total

    def forget_support(self) -> None:
        """m's support is unknown (another path ran, a checkpoint was loaded): the next step
        takes the general branch, which reads m and e everywhere."""
        self._pidx = None

    def drop_plans(self) -> None:
        """The index plans were made for another partition (``ScapeStrategy.repartition``)."""
        self._plans.clear()

    def finish_residual(self, mask: Mask) -> None:
        """The reference's separate fold (first step): here update() and finish_step() fold."""

    def finish_step(self) -> dict[str, torch.Tensor]:
        """After the next mask's top-k: nothing left to do (the sharded step folded in its
        update; the replicated one folds now)."""
        return {}

    def _plan(self, counts: list[list[int]]) -> _Plan:
        key = tuple(map(tuple, counts))
        if key not in self._plans:
            self._plans.clear()      # the current density's plan only (a warm-up visits many)
            self._plans[key] = _Plan(self.part, self.layout, counts)
        return self._plans[key]

    def _passes(self, grads=None):
        """The chosen passes, or the torch ones where the Triton kernels do not apply: a
        low-precision payload, gradients that are not one flat fp32 buffer."""
        if self.codec.lowp or (grads is not None and self._lib is not self._torch and (
                grads[0].dtype != torch.float32
                or passes.flat_buffer(grads, self.layout.offsets) is None)):
            return self._torch
        return self._lib

    def _segments(self, plan: _Plan, lo: int, hi: int, src=None) -> list[passes.ParamSegment]:
        """The passes' segments of the index-list slice ``[lo, hi)`` (``src(a)``: where a
        segment's values start in a gathered buffer), built once per plan: the same list object
        every step, whose device tables the Triton passes keep. The segments view θ's storage,
        which loads write in place."""
        key = (lo, hi, src is None)
        hit = plan.param_segs.get(key)
        if hit is None:
            lay = self.layout
            hit = plan.param_segs[key] = [
                passes.ParamSegment(lay.flat_view(t), lay.offsets[t], a, b, s0, s1,
                                    lay.weight_decay[t], 0 if src is None or a == b else src(a))
                for (t, a, b), (s0, s1) in zip(plan.segs, plan.spans) if a >= lo and b <= hi]
        return hit

    def _adams_step(self, lr: float, step: int) -> AdamSConstants:
        """The step's constants (the weight decay is the segments', :meth:`_segments`)."""
        cfg = self.cfg
        return AdamSConstants(step, lr, *cfg.betas, cfg.eps, 0.0, cfg.bias_correction)


class FusedReplicatedScape(_FusedEngine):
    """Replicated mode (§2); the residual buffer holds ``c`` between prepare() and finish_step()."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._c: torch.Tensor | None = None
        self._idx: torch.Tensor | None = None
        self._zero_pending = False
        self._wire_err: torch.Tensor | None = None   # a low-precision payload's error at M_t
        self._c_sq: torch.Tensor | None = None   # Σ c², from the prepare
        self._cut: torch.Tensor | None = None    # Σ_M c², from the payload's gather

    def prepare(self, g, mask: Mask | None, counts: list[list[int]] | None = None
                ) -> torch.Tensor:
        """§2 line 1: ``e ← c = β1·m + (1-β1)·g + e``. ``g``: the per-tensor gradients (flattened
        views of ``p.grad``, consumed: scaled in place). The residual fold ``e = (1-M)⊙c``
        happens in :meth:`finish_step`, after the top-k read ``c``; ``mask`` and ``counts``
        (M_t) are part of the engines' common call, which the reference's fold reads."""
        beta1, offs, m = self.cfg.betas[0], self.layout.offsets, self.state.m
        lib = self._passes(g)
        if self._pidx is None:      # m may be nonzero anywhere (first step, after a load)
            e = self.state.residual.tensor()
            self._c_sq = lib.prepare_general(g, offs, e, m, beta1, 1.0 - beta1)
        else:                       # m and e_{t-1}: nonzero on disjoint sets; every pass writes
            # e at m's support before reading it: the deferred fold there is skipped
            e = self.state.residual.overwriting(self._pidx)
            self._c_sq = lib.prepare(g, offs, e, m, self._pidx, self._prev.segs, beta1,
                                     1.0 - beta1)
        self._c = e
        lo, hi = self.part.ranges[self.comm.rank]
        return e[lo:hi]

    def update(self, mask: Mask, lr: float, step: int, counts: list[list[int]],
               during_payload=None) -> tuple[dict, object]:
        """§2 lines 2, 4-7, O(k); ``during_payload`` (the next mask's top-k, which reads
        the candidate only) runs while the payload's all-reduce is in flight, and what it
        returned comes back beside the metrics."""
        cfg, c, m = self.cfg, self._c, self.state.m
        assert c is not None, "prepare() first"
        if self.record:
            self.last = {"c": c.clone(), "m_prev": m.clone()}
        k = sum(map(sum, counts))
        idx = mask.index(k)
        lib = self._passes()
        payload, m_old = (torch.empty(k, dtype=torch.float32, device=c.device) for _ in range(2))
        self._cut = lib.gather(idx, c, payload)         # and Σ_M c², for the metric
        if self.codec.lowp:
            # the quantized mean is two blocking collectives; the next mask's top-k, which reads
            # c only, runs before them. This rank's error goes into e[M] (finish_step).
            overlapped = None if during_payload is None else during_payload()
            payload, self._wire_err = quantized_mean(payload, self.comm, self.codec,
                                                     kind="payload")
            if self.record:
                self.last["wire_error"] = self._wire_err.clone()
        else:
            overlapped = _overlapped(self.comm.all_reduce(payload, kind="payload", average=True,
                                                          async_op=True), during_payload)
        if self.record:
            self.last["payload"] = payload.clone()
        # payload becomes ĝ = (b̄ - β1·m) / (1-β1); m at the mask gathered into m_old, for AdamS
        norm = _root(lib.ghat(payload, m_old, cfg.betas[0], idx=idx, m=m)).float()
        clip = passes.Clip(norm, cfg.clip_grad) if cfg.clip_grad > 0 else None
        if self.record:
            clipped = payload if clip is None else payload * clip_coef(*clip)
            self.last["ghat"] = torch.zeros_like(c).index_copy_(0, idx, clipped)
        plan = self._plan(counts)
        lib.adams(idx, 0, 0, payload, m_old, m, self._pidx, self._segments(plan, 0, k),
                  self._adams_step(lr, step), clip)         # θ, m
        self._pidx, self._prev = idx, plan
        self._idx, self._zero_pending = idx, True
        self._c = None
        return {"grad_norm": norm, "scape/payload_numel": float(k)}, overlapped

    def finish_step(self) -> dict[str, torch.Tensor]:
        """§2 line 3 after the next mask's top-k: ``e[M] ← 0`` (O(k)); the residual norm."""
        c_sq, self._c_sq = self._c_sq, None
        cut, self._cut = self._cut, None
        if self._zero_pending:
            self._zero_pending = False
            if self._wire_err is not None:      # e[M] = the quantization error, not 0
                e = self.state.residual.tensor()
                e.index_copy_(0, self._idx, self._wire_err)
                self._wire_err = None
                # e is nonzero on m's support now: the next prepare must read it there
                self.forget_support()
                return {"scape/residual_norm": torch.linalg.vector_norm(e).double()}
            # ‖(1-M)⊙c‖² = Σ c² - Σ_M c² (the prepare's and the payload gather's sums, in
            # double); the fold e[M] = 0 itself is deferred: the next prepare overwrites
            # those positions (m's support), any other reader of e gets it applied
            self.state.residual.defer_zero(self._idx)
            return {"scape/residual_norm": _root(c_sq, cut)}
        e = self.state.residual.tensor()
        return {"scape/residual_norm": torch.linalg.vector_norm(e).double()}

    def forget_support(self) -> None:
        super().forget_support()
        self._zero_pending = False


class FusedShardedScape(_FusedEngine):
    """Sharded mode (§3); ``ρ`` holds the owner's ``base = β1·m + ρ`` between prepare() and
    update(), the full-size ``ε`` holds ``x = (1-β1)·g + ε``."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.lo, self.hi = self.part.ranges[self.comm.rank]
        self._x: torch.Tensor | None = None
        self._pidx_own: torch.Tensor | None = None
        self._x_sq: torch.Tensor | None = None   # Σ x², from the prepare

    def prepare(self, g, mask: Mask | None, counts: list[list[int]] | None = None
                ) -> torch.Tensor:
        """§3's prepare: ``ε ← x = (1-β1)·g + ε`` (``g``: per-tensor gradients, consumed),
        ``ρ ← base``; returns ``c^(o) = base + x`` on the own range."""
        beta1 = self.cfg.betas[0]
        self._x = self.state.residual.tensor()
        # m's support unknown: ρ ← β1·m + ρ everywhere, in the torch ops
        lib = self._passes(g) if self._pidx is not None else self._torch
        cand = torch.empty(self.hi - self.lo, dtype=torch.float32, device=self._x.device)
        self._x_sq = lib.prepare_sharded(g, self.layout.offsets, self._x, self.state.rho,
                                         self.state.m, self._pidx_own, self.lo, self.hi, cand,
                                         beta1, 1.0 - beta1)
        return cand

    def update(self, mask: Mask, lr: float, step: int, seg_counts: list[list[int]],
               during_payload=None) -> tuple[dict, object]:
        """§3's update, O(k): the payload's rows taken from x (ε = (1-M)⊙x), ĝ and ρ's fold,
        AdamS into the owner's shard, the parameters from the gathered shards;
        ``during_payload`` runs while the payload's reduce-scatter is in flight (it reads the
        owner's candidate, a buffer of its own)."""
        cfg, x, comm, m = self.cfg, self._x, self.comm, self.state.m
        assert x is not None, "prepare() first"
        world, rank, lo = comm.world, comm.rank, self.lo
        if self.record:
            self.last = {"x": x.clone()}
        counts = [sum(c) for c in seg_counts]
        width, total = max(1, max(counts)), sum(counts)
        starts = [sum(counts[:r]) for r in range(world)]
        k_own, s_own = counts[rank], starts[rank]
        idx = mask.index(total)
        own = idx[s_own:s_own + k_own]
        lib = self._passes()
        send = torch.zeros(world, width, dtype=torch.float32, device=x.device)
        cut = 0.0
        for r, k in enumerate(counts):   # the payload rows, and ε = (1-M)⊙x in one pass
            if k:
                cut = cut + lib.take(idx[starts[r]:starts[r] + k], x, send[r, :k])
        wire_err = None
        if self.codec.lowp:
            # the coded mean is blocking collectives; the next mask's top-k (it reads the
            # owner's candidate only) runs first. This rank's error goes into ε[M].
            overlapped = None if during_payload is None else during_payload()
            recv, sent = reduce_scatter_mean(send, comm, self.codec, kind="payload")
            err = send.sub_(sent)
            wire_err = torch.cat([err[r, :k] for r, k in enumerate(counts)])
            x.index_copy_(0, idx, wire_err)
            if self.record:
                self.last["wire_error"] = wire_err.clone()
        else:
            recv = torch.empty(width, dtype=torch.float32, device=x.device)
            overlapped = _overlapped(comm.reduce_scatter(recv, send.view(-1), kind="payload",
                                                         average=True, async_op=True),
                                     during_payload)
        del send
        if self.record:
            self.last["reduced"] = recv[:k_own].clone()
        ghat = recv[:k_own]     # b̄ becomes ĝ; ρ = (1-M)⊙base; m at the mask gathered into m_old
        m_old = torch.empty(k_own, dtype=torch.float32, device=x.device)
        sq = lib.ghat(ghat, m_old, cfg.betas[0], idx=own, base=lo, rho=self.state.rho, m=m)
        sq = sq.float().reshape(1)
        comm.all_reduce(sq, kind="norm", average=False)
        norm = sq.sqrt()[0]
        clip = passes.Clip(norm, cfg.clip_grad) if cfg.clip_grad > 0 else None
        x_sq, self._x_sq = self._x_sq, None
        res = (torch.linalg.vector_norm(x).double() if x_sq is None or wire_err is not None
               else _root(x_sq, cut))
        plan = self._plan(seg_counts)
        own_segs = self._segments(plan, s_own, s_own + k_own)
        shard = torch.zeros(width, dtype=torch.float32, device=x.device)
        if k_own:     # θ·(1 - lr·wd) + the update into the shard; θ itself is not written yet
            lib.adams(idx, s_own, lo, ghat, m_old, m, self._pidx_own, own_segs,
                      self._adams_step(lr, step), clip, out=shard)        # and m (own range)
        elif self._pidx_own is None:
            m.zero_()
        else:
            m.index_fill_(0, self._pidx_own, 0.0)
        segs = self._segments(plan, 0, total, lambda a: _gathered_at(a, starts, counts, width))
        if wire_err is None:
            gathered = torch.empty(width * world, dtype=torch.float32, device=x.device)
            comm.all_gather(gathered, shard, kind="params")
            # θ from the gathered shards at the mask, θ·(1 - lr·wd) elsewhere
            lib.scatter_params(idx, segs, gathered, lr)
        else:
            self._sync_param_updates(idx, shard, own_segs, s_own, own - lo, segs, lr)
        self._pidx, self._pidx_own, self._prev = idx, own - lo, plan
        self._x = None
        return {"grad_norm": norm, "scape/payload_numel": float(total),
                "scape/residual_norm": res}, overlapped

    def _sync_param_updates(self, idx: torch.Tensor, shard: torch.Tensor,
                            own_segs: list[passes.ParamSegment], j0: int, own: torch.Tensor,
                            segs: list[passes.ParamSegment], lr: float) -> None:
        """A low-precision payload's parameter sync (the reference's ``_sync_param_updates``,
        O(k)): the owner sends ``δ = θ_new - (1-lr·wd)·θ + u`` at its mask entries, coded like
        the payload, and keeps ``u ← δ - deq(q(δ))``; every rank then adds every owner's decoded
        update to its decayed θ at the mask."""
        k_own, rank, ops = own.numel(), self.comm.rank, self._torch
        u = self.state.update_residual
        if k_own:
            decayed = ops.params_at(idx, own_segs)
            for s in own_segs:
                if s.decay(lr) != 1.0:
                    decayed[s.a - j0:s.b - j0].mul_(s.decay(lr))
            shard[:k_own].sub_(decayed).add_(u.index_select(0, own))
        applied = all_gather_rows(shard, self.comm, self.codec, kind="params")
        if self.record:
            self.last["update_target"] = shard[:k_own].clone()
            self.last["update_sent"] = applied[rank, :k_own].clone()
        if k_own:
            u.index_copy_(0, own, shard[:k_own].sub_(applied[rank, :k_own]))
        if segs:      # θ[M] ← (1-lr·wd)·θ[M] + the decoded update, on every rank alike
            applied = applied.reshape(-1)
            ops.decay(segs, lr)
            theta = ops.params_at(idx, segs).add_(torch.cat(
                [applied[s.src:s.src + s.b - s.a] for s in segs]))
            ops.write_params(idx, segs, [theta[s.a:s.b] for s in segs])

    def forget_support(self) -> None:
        self._pidx = self._pidx_own = None
