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
  - AdamS runs on the k gathered values; off the mask the parameters only get weight decay.
    The torch ops apply it as one ``torch._foreach_mul_`` over the decayed tensors and index-copy
    the new values at the mask positions into each parameter's flat view (one op per segment,
    on k-sized slices); the Triton kernels decay in one coalesced launch before AdamS. The old
    momentum at the mask is stored by the ĝ pass, which reads it anyway, so AdamS reads it
    contiguously instead of gathering it again.

Values: the same elementwise ops in the same order as the reference on every coordinate (the
off-mask candidate is ``round((1-β1)·g) + e``, as the reference's ``β1·0 + (1-β1)·g`` then
``+ e``), so results agree bit for bit wherever torch's CPU kernels round alike; the one known
source of difference is that a vectorized ``add(alpha=)``/``addcmul`` may use an FMA in the body
of a tensor and a separate multiply-add in its scalar tail, and the k-sized gathered tensors put
different coordinates in the tail than the full-size ones (≤ 1 ulp per op).

Two implementations of these passes, chosen once (:func:`.kernels.select_passes`): Triton kernels
on CUDA (:mod:`.triton_passes`, taking tensors and :mod:`.passes`' segments and AdamS constants,
one pass per phase over the mask's indices, the square sums for the residual-norm metric taken
on the way and returned on the device); elsewhere -- the
CPU, ``use_triton=off``, a recording test step -- the torch ops written out below, which are
also what the kernels are tested against (tests/test_triton_passes.py).

The engines work on the reference engine's state (:class:`.state.ScapeState`); the strategy
runs the reference engine instead for what they do not cover (:func:`fuses`: offloaded residuals,
walked in host chunks) and for steps at a density where the full-size passes are cheaper
(:meth:`_FusedEngine.accepts`). A low-precision payload takes the torch ops below, not the
Triton passes.
"""

from __future__ import annotations

import torch

from scape_train.comm import Comm
from ...host_to_device import upload
from ..config import OptimizerConfig
from . import passes
from .masks import Mask
from .partition import ParamLayout, PartitionMap
from .payload import PayloadCodec, all_gather_rows, all_reduce_mean, reduce_scatter_mean
from .replicated import clip_coef
from .state import ScapeState


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


def _root(sq: torch.Tensor, cut=0.0) -> torch.Tensor:
    """``sqrt(max(sq - cut, 0))``: a norm from a pass's sum of squares, on the device."""
    return (sq - cut).clamp_min(0.0).sqrt()


def _gathered_at(a: int, starts: list[int], counts: list[int], width: int) -> int:
    """Where index-list entry ``a`` sits in the parameter all-gather: owners' shards are
    ``width`` apart, owner r's values start at its ``starts[r]``-th index."""
    r = max(q for q in range(len(starts)) if starts[q] <= a and counts[q])
    return r * width + a - starts[r]


class _MaskIndex:
    """A mask's sorted flat indices, cut by the plan's segments ``(tensor, a, b)``; the
    per-tensor indices (flat minus the tensor's offset) are computed when a torch op needs
    them -- the kernels take the flat ones and the offsets. ``spans``: each segment's elements
    ``(s0, s1)`` in its tensor; ``empty``: ``(tensor, s0, s1)`` of the segments without ones
    (a mask measured from a checkpoint of another world size can leave one so)."""

    def __init__(self, plan: tuple, idx: torch.Tensor):
        self.segs, self._offsets, _, self.spans, self.empty = plan
        self.idx = idx
        self._local: torch.Tensor | None = None

    @property
    def local(self) -> torch.Tensor:
        if self._local is None:
            self._local = self.idx - self._offsets
        return self._local


def fuses(offload_residuals: bool) -> bool:
    """Whether a configuration can take the O(k) step at all: not with an offloaded residual
    (walked in host chunks by the reference). A low-precision payload takes the torch ops (the
    Triton passes move fp32 values)."""
    return not offload_residuals


class _FusedEngine:
    """Shared by both fused engines: index plans, the AdamS math on k values, parameter IO.
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
        self._lib = lib        # the Triton passes (kernels.select_passes), or None: torch ops
        self._pidx: torch.Tensor | None = None      # previous mask's indices (m's support)
        self._idx: torch.Tensor | None = None
        self._plans: dict[tuple, tuple] = {}
        lay = self.layout
        by_wd: dict[float, list[int]] = {}
        for i, wd in enumerate(lay.weight_decay):
            if wd != 0.0:
                by_wd.setdefault(wd, []).append(i)
        self._decay_groups = list(by_wd.items())

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

    def finish_residual(self, mask: Mask) -> None:
        """The reference's separate fold (first step): here update() and finish_step() fold."""

    def finish_step(self) -> dict[str, torch.Tensor]:
        """After the next mask's top-k: nothing left to do (the sharded step folded in its
        update; the replicated one folds now)."""
        return {}

    # -- plans: the mask's index ranges per segment, from the host-known counts --------------
    def _plan(self, counts: list[list[int]]) -> tuple:
        """For the flat index list of a mask with ``counts`` ones per segment (all ranks, flat
        order): per segment ``(tensor, start, end)`` of its slice of the index list, plus each
        index's tensor offset (to turn flat indices into per-tensor ones with one subtraction)."""
        key = tuple(map(tuple, counts))
        plan = self._plans.get(key)
        if plan is None:
            self._plans.clear()      # the current density's plan only (a warm-up visits many)
            lay = self.layout
            segs, offs, reps, spans, empty, at = [], [], [], [], [], 0
            for rank_segs, rank_counts in zip(self.part.segments, counts):
                for seg, k in zip(rank_segs, rank_counts):
                    s0 = seg.flat_start - lay.offsets[seg.tensor]
                    if k:
                        segs.append((seg.tensor, at, at + k))
                        offs.append(lay.offsets[seg.tensor])
                        reps.append(k)
                        spans.append((s0, s0 + seg.numel))
                    elif seg.numel:
                        empty.append((seg.tensor, s0, s0 + seg.numel))
                    at += k
            dev = lay.device
            # per segment on the host, per index on the device: a k-sized host vector would be
            # a blocking copy of up to 8k bytes on every step of a density warm-up
            offsets = (torch.repeat_interleave(upload(offs, dev), upload(reps, dev),
                                               output_size=at)
                       if segs else torch.zeros(0, dtype=torch.int64, device=dev))
            plan = (segs, offsets, at, spans, empty)
            self._plans[key] = plan
        return plan

    def _index(self, idx: torch.Tensor, counts: list[list[int]]) -> _MaskIndex:
        return _MaskIndex(self._plan(counts), idx)

    # -- the Triton passes, one per phase ------------------------------------------------------
    def _passes(self, grads=None):
        """The Triton kernels (CUDA) for this step, or ``None`` (the CPU, ``use_triton=off``, a
        recording test step, a gradient that is not contiguous fp32: the torch ops below run)."""
        if self.record or self.codec.lowp:
            return None
        if grads is not None and not all(g.dtype == torch.float32 and g.is_contiguous()
                                         for g in grads):
            return None
        return self._lib

    def _segments(self, mi: _MaskIndex, lo: int, hi: int, lr: float, src=None
                  ) -> list[passes.ParamSegment]:
        """The passes' segments of the index-list slice ``[lo, hi)`` (``src(a)``: where a
        segment's values start in a gathered buffer)."""
        lay = self.layout
        return [passes.ParamSegment(lay.flat_view(t), lay.offsets[t], a, b, s0, s1,
                                    1.0 - lr * lay.weight_decay[t], 0 if src is None else src(a))
                for (t, a, b), (s0, s1) in zip(mi.segs, mi.spans) if a >= lo and b <= hi]

    def _decay_empty(self, mi: _MaskIndex, lr: float) -> None:
        """The weight decay of the segments no parameter table lists (no ones in the mask)."""
        lay = self.layout
        for t, s0, s1 in mi.empty:
            if lay.weight_decay[t] != 0.0:
                lay.flat_view(t)[s0:s1].mul_(1.0 - lr * lay.weight_decay[t])

    def _adams_step(self, lr: float, step: int) -> passes.AdamSStep:
        cfg = self.cfg
        return passes.AdamSStep(lr, *cfg.betas, cfg.eps, cfg.bias_correction, step)

    # -- gradients: read where autograd left them ----------------------------------------------
    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor views of a flat state tensor (cached: the state tensors are persistent)."""
        key = (id(flat), flat.numel())     # the cached views keep ``flat`` (and its id) alive
        if getattr(self, "_views_key", None) != key:
            offs = self.layout.offsets
            self._views_cache = [flat[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]
            self._views_key = key
        return self._views_cache

    def _grads_at(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The gradients at the previous mask's indices (k values, flat order)."""
        segs, local = self._prev_local.segs, self._prev_local.local
        parts = [grads[t].index_select(0, local[a:b]) for t, a, b in segs]
        if not parts:
            return torch.zeros(0, dtype=torch.float32, device=self.layout.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _add_scaled_grads(self, dst: torch.Tensor, grads: list[torch.Tensor]) -> None:
        """``dst += (1-β1)·g`` per tensor: the gradients are scaled in place (the step consumes
        them) and added, ``round((1-β1)·g) + dst`` as the reference's ops round."""
        torch._foreach_mul_(grads, 1.0 - self.cfg.betas[0])
        torch._foreach_add_(self._views(dst), grads)

    # -- parameters ----------------------------------------------------------------------------
    def _decay(self, lr: float) -> None:
        """``θ ← (1 - lr·wd)·θ`` on every decayed tensor (the off-mask update, and the first
        half of the on-mask one, exactly as ``adams_update_`` orders it)."""
        lay = self.layout
        for wd, ids in self._decay_groups:
            torch._foreach_mul_([lay.params[i].data for i in ids], 1.0 - lr * wd)

    def _gather_params(self, segs: list, local: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """θ at the index-list slice ``[lo, hi)`` (whole segments), as one k-sized tensor."""
        lay = self.layout
        parts = [lay.flat_view(t).index_select(0, local[a:b]) for t, a, b in segs
                 if a >= lo and b <= hi]
        if not parts:
            return torch.zeros(0, dtype=torch.float32, device=lay.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _scatter_params(self, segs: list, local: torch.Tensor, values: torch.Tensor,
                        value_at=None) -> None:
        """θ ← ``values`` at every segment's mask positions (``value_at(a, b)``: the values of
        the index-list slice ``[a, b)``; default ``values[a:b]``)."""
        lay = self.layout
        for t, a, b in segs:
            v = values[a:b] if value_at is None else value_at(a, b)
            lay.flat_view(t).index_copy_(0, local[a:b], v)

    # -- AdamS on k values ---------------------------------------------------------------------
    def _adams_k(self, m_c: torch.Tensor, ghat_c: torch.Tensor, theta_c: torch.Tensor,
                 lr: float, step: int) -> torch.Tensor:
        """``adams_update_``'s ops on the gathered values, the decay already applied to
        ``theta_c``; returns the new momentum (``m_c`` is overwritten); ``theta_c`` in place."""
        hp = self._adams_step(lr, step)
        prev = m_c / hp.bc1 if hp.bias_correction == "official" else m_c
        v = prev.square().mul_(hp.beta2).addcmul_(ghat_c, ghat_c, value=1.0 - hp.beta2)
        m_new = m_c.mul_(hp.beta1).add_(ghat_c, alpha=1.0 - hp.beta1)
        denom = v.sqrt_()
        if hp.bias_correction == "adam":
            denom.div_(hp.sqrt_bc2)
        theta_c.addcdiv_(m_new, denom.add_(hp.eps), value=-hp.step_size)
        return m_new

    def _set_momentum(self, m: torch.Tensor, idx: torch.Tensor, m_new: torch.Tensor) -> None:
        """``m ← 0`` off the mask (only the previous mask can be nonzero), ``m[idx] ← m_new``."""
        if self._pidx is None:
            m.zero_()
        else:
            m.index_fill_(0, self._pidx, 0.0)
        m.index_copy_(0, idx, m_new)
        self._pidx = idx



class FusedReplicatedScape(_FusedEngine):
    """Replicated mode (§2); the residual buffer holds ``c`` between prepare() and finish_step()."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._c: torch.Tensor | None = None
        self._zero_pending = False
        self._wire_err: torch.Tensor | None = None   # a low-precision payload's error at M_t
        self._c_sq: torch.Tensor | None = None   # Σ c² from the kernels' prepare
        self._cut = None                    # Σ_M c² from the kernels' payload gather

    def prepare(self, g, mask: Mask | None, counts: list[list[int]] | None = None
                ) -> torch.Tensor:
        """§2 line 1: ``e ← c = β1·m + (1-β1)·g + e``. ``g``: the per-tensor gradients (flattened views of
        ``p.grad``, consumed: scaled in place). The residual fold ``e = (1-M)⊙c`` happens in
        :meth:`finish_step`, after the top-k read ``c``; ``mask`` and ``counts`` (M_t) are part of
        the engines' common call, which the reference's fold reads."""
        beta1 = self.cfg.betas[0]
        # with m's support known, every branch writes e there before reading it: the previous
        # step's deferred fold (e[M] = 0, finish_step) is skipped, not applied
        e = (self.state.residual.tensor() if self._pidx is None
             else self.state.residual.overwriting(self._pidx))
        self._c_sq = None
        lib = self._passes(g)
        offs = self.layout.offsets
        if self._pidx is None and lib is not None:   # the general line below, in kernels
            self._c_sq = lib.prepare_general(g, offs, e, self.state.m, beta1, 1.0 - beta1)
        elif self._pidx is None:        # m may be nonzero anywhere (first step, after a load)
            w = torch._foreach_mul(self._views(self.state.m), beta1)
            torch._foreach_add_(w, g, alpha=1.0 - beta1)
            torch._foreach_add_(self._views(e), w)
        elif lib is not None:           # the two lines below, in kernels; Σ c², for the metric
            self._c_sq = lib.prepare(g, offs, e, self.state.m, self._pidx,
                                     self._prev_local.segs, beta1, 1.0 - beta1)
        else:                           # m and e_{t-1}: nonzero on disjoint sets
            pidx = self._pidx
            c_p = self.state.m.index_select(0, pidx).mul_(beta1).add_(self._grads_at(g),
                                                                alpha=1.0 - beta1)
            self._add_scaled_grads(e, g)
            e.index_copy_(0, pidx, c_p)
        self._c = e
        lo, hi = self.part.ranges[self.comm.rank]
        return e[lo:hi]

    def update(self, mask: Mask, lr: float, step: int, counts: list[list[int]],
               during_payload=None) -> tuple[dict, object]:
        """§2 lines 2, 4-7, O(k); ``during_payload`` (the next mask's top-k, which reads
        the candidate only) runs while the payload's all-reduce is in flight, and what it
        returned comes back beside the metrics."""
        cfg, c = self.cfg, self._c
        assert c is not None, "prepare() first"
        beta1 = cfg.betas[0]
        if self.record:
            self.last = {"c": c.clone(), "m_prev": self.state.m.clone()}
        k = sum(map(sum, counts))
        idx = mask.index(k)
        lib = self._passes()
        if lib is not None:
            return self._update_passes(lib, idx, k, counts, lr, step, during_payload)
        payload = c.index_select(0, idx)
        if self.codec.lowp:
            # the quantized mean is two blocking collectives; the next mask's top-k, which reads
            # c only, runs before them. This rank's error goes into e[M] (finish_step).
            overlapped = None if during_payload is None else during_payload()
            payload, self._wire_err = all_reduce_mean(payload, self.comm, self.codec,
                                                      kind="payload")
            if self.record:
                self.last["wire_error"] = self._wire_err.clone()
        else:
            overlapped = _overlapped(self.comm.all_reduce(payload, kind="payload", average=True,
                                                          async_op=True), during_payload)
        m_c = self.state.m.index_select(0, idx)
        ghat_c = m_c.mul(-beta1).add_(payload).div_(1.0 - beta1)    # (b̄ - β1·m) / (1-β1)
        norm = torch.linalg.vector_norm(ghat_c)
        if cfg.clip_grad > 0:
            ghat_c.mul_(clip_coef(norm, cfg.clip_grad))
        if self.record:
            ghat = torch.zeros_like(c).index_copy_(0, idx, ghat_c)
            self.last.update(payload=payload.clone(), ghat=ghat)
        mi = self._index(idx, counts)
        segs, local = mi.segs, mi.local
        self._decay(lr)
        theta_c = self._gather_params(segs, local, 0, k)
        m_new = self._adams_k(m_c, ghat_c, theta_c, lr, step)
        self._scatter_params(segs, local, theta_c)
        self._set_momentum(self.state.m, idx, m_new)
        self._prev_local = mi
        self._idx, self._zero_pending = idx, True
        self._c = None
        return {"grad_norm": norm, "scape/payload_numel": float(k)}, overlapped

    def _update_passes(self, lib, idx: torch.Tensor, k: int, counts: list[list[int]],
                       lr: float, step: int, during_payload) -> tuple[dict, object]:
        """:meth:`update` with its O(k) passes in Triton: the payload, ĝ and its norm, AdamS at
        the mask positions with the weight decay in its walk of θ, the momentum; the all-reduce
        as on the torch path."""
        cfg, c, m = self.cfg, self._c, self.state.m
        payload, m_old = (torch.empty(k, dtype=torch.float32, device=c.device) for _ in range(2))
        self._cut = lib.gather(idx, c, payload)    # and Σ_M c², for the metric
        overlapped = _overlapped(self.comm.all_reduce(payload, kind="payload", average=True,
                                                      async_op=True), during_payload)
        # payload becomes ĝ; m at the mask gathered into m_old, for AdamS
        sq = lib.ghat(payload, m_old, cfg.betas[0], idx=idx, m=m)
        norm = _root(sq).float()
        coef = clip_coef(norm, cfg.clip_grad) if cfg.clip_grad > 0 else None
        mi = self._index(idx, counts)
        lib.adams(idx, 0, 0, payload, m_old, m, self._pidx, self._segments(mi, 0, k, lr),
                  self._adams_step(lr, step), coef)                            # and m
        self._decay_empty(mi, lr)
        self._pidx = idx
        self._prev_local = mi
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
            if c_sq is not None and cut is not None:
                # ‖(1-M)⊙c‖² = Σ c² - Σ_M c² (the prepare's and the payload gather's sums, in
                # double); the fold e[M] = 0 itself is deferred: the next prepare overwrites
                # those positions (m's support), any other reader of e gets it applied
                self.state.residual.defer_zero(self._idx)
                return {"scape/residual_norm": _root(c_sq, cut)}
            self.state.residual.tensor().index_fill_(0, self._idx, 0.0)
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
        self._x_sq: torch.Tensor | None = None   # Σ x² from the kernels' prepare

    def prepare(self, g, mask: Mask | None, counts: list[list[int]] | None = None
                ) -> torch.Tensor:
        """§3's prepare: ``ε ← x = (1-β1)·g + ε`` (``g``: per-tensor gradients, consumed),
        ``ρ ← base``; returns ``c^(o) = base + x`` on the own range."""
        beta1 = self.cfg.betas[0]
        eps_ = self.state.residual.tensor()
        lib = self._passes(g) if self._pidx is not None else None
        self._x_sq, self._x = None, eps_
        if lib is not None:            # ε ← x, ρ ← base and c^(o) = base + x^(o), in one pass
            cand = torch.empty(self.hi - self.lo, dtype=torch.float32, device=eps_.device)
            self._x_sq = lib.prepare_sharded(g, self.layout.offsets, eps_, self.state.rho,
                                             self.state.m, self._pidx_own, self.lo, self.hi,
                                             cand, beta1, 1.0 - beta1)
            return cand
        self._add_scaled_grads(eps_, g)                      # ε ← x
        if self._pidx is None:
            self.state.rho = torch.mul(self.state.m, beta1).add_(self.state.rho)
        else:                                                # ρ = 0 where m may be nonzero
            p = self._pidx_own
            self.state.rho.index_copy_(0, p, self.state.m.index_select(0, p).mul_(beta1))
        return torch.add(self.state.rho, eps_[self.lo:self.hi])    # base + x^(o) = c^(o)

    def update(self, mask: Mask, lr: float, step: int, seg_counts: list[list[int]],
               during_payload=None) -> tuple[dict, object]:
        """§3's update, O(k); ``during_payload`` runs while the payload's
        reduce-scatter is in flight (it reads the owner's candidate, a buffer of its own)."""
        cfg, x, comm = self.cfg, self._x, self.comm
        assert x is not None, "prepare() first"
        beta1 = cfg.betas[0]
        world, rank = comm.world, comm.rank
        if self.record:
            self.last = {"x": x.clone()}
        counts = [sum(c) for c in seg_counts]
        width = max(1, max(counts))
        total = sum(counts)
        starts = [sum(counts[:r]) for r in range(world)]
        idx = mask.index(total)
        lib = self._passes()
        if lib is not None:
            return self._update_passes(lib, idx, seg_counts, counts, starts, width, lr, step,
                                       during_payload)
        payload = x.index_select(0, idx)
        send = torch.zeros(world, width, dtype=torch.float32, device=x.device)
        for r, k in enumerate(counts):
            if k:
                send[r, :k] = payload[starts[r]:starts[r] + k]
        wire_err = None
        if self.codec.lowp:
            # the coded mean is blocking collectives; the next mask's top-k (it reads the
            # owner's candidate only) runs first. This rank's error goes into ε[M], below.
            overlapped = None if during_payload is None else during_payload()
            recv, sent = reduce_scatter_mean(send, comm, self.codec, kind="payload")
            err = send.sub_(sent)
            wire_err = torch.cat([err[r, :k] for r, k in enumerate(counts)])
            if self.record:
                self.last["wire_error"] = wire_err.clone()
        else:
            recv = torch.empty(width, dtype=torch.float32, device=x.device)
            overlapped = _overlapped(comm.reduce_scatter(recv, send.view(-1), kind="payload",
                                                         average=True, async_op=True),
                                     during_payload)
        if self.record:
            self.last["reduced"] = recv[:counts[rank]].clone()
        k_own, s_own = counts[rank], starts[rank]
        own_idx = idx[s_own:s_own + k_own] - self.lo
        b_c = recv[:k_own].add_(self.state.rho.index_select(0, own_idx))
        m_c = self.state.m.index_select(0, own_idx)
        ghat_c = m_c.mul(-beta1).add_(b_c).div_(1.0 - beta1)
        sq = ghat_c.double().square().sum().float().reshape(1)
        comm.all_reduce(sq, kind="norm", average=False)
        norm = sq.sqrt()[0]
        if cfg.clip_grad > 0:
            ghat_c.mul_(clip_coef(norm, cfg.clip_grad))
        self.state.rho.index_fill_(0, own_idx, 0.0)          # ρ = (1-M)⊙base
        if wire_err is None:
            x.index_fill_(0, idx, 0.0)                       # ε = (1-M)⊙x
        else:
            x.index_copy_(0, idx, wire_err)                  # ... + the wire error at M
        res_sq = torch.linalg.vector_norm(x).double().square()
        mi = self._index(idx, seg_counts)
        segs, local = mi.segs, mi.local
        self._decay(lr)
        shard = torch.zeros(width, dtype=torch.float32, device=x.device)
        theta_c = self._gather_params(segs, local, s_own, s_own + k_own) if k_own else None
        decayed_c = theta_c.clone() if k_own and wire_err is not None else None
        m_new = self._adams_k(m_c, ghat_c, theta_c, lr, step) if k_own else m_c
        if wire_err is None:
            if k_own:
                shard[:k_own] = theta_c
            gathered = torch.empty(width * world, dtype=torch.float32, device=x.device)
            comm.all_gather(gathered, shard, kind="params")
        else:
            gathered = self._sync_param_updates(shard, theta_c, decayed_c, own_idx)

        def value_at(a: int, b: int) -> torch.Tensor:
            at = _gathered_at(a, starts, counts, width)
            return gathered[at:at + b - a]

        if wire_err is None:
            self._scatter_params(segs, local, gathered, value_at)
        else:       # θ[M] ← (1-lr·wd)·θ[M] + the decoded update, on every rank alike
            for t, a, b in segs:
                view, at = self.layout.flat_view(t), local[a:b]
                view.index_copy_(0, at, view.index_select(0, at).add_(value_at(a, b)))
        if self._pidx is None:
            self.state.m.zero_()
        else:
            self.state.m.index_fill_(0, self._pidx_own, 0.0)
        self.state.m.index_copy_(0, own_idx, m_new)
        self._pidx, self._pidx_own = idx, own_idx
        self._prev_local = mi
        self._x = None
        return {"grad_norm": norm, "scape/payload_numel": float(total),
                "scape/residual_norm": res_sq.sqrt()}, overlapped

    def _sync_param_updates(self, shard: torch.Tensor, theta_c: torch.Tensor | None,
                            decayed_c: torch.Tensor | None, own_idx: torch.Tensor
                            ) -> torch.Tensor:
        """A low-precision payload's parameter sync (the reference's ``_sync_param_updates``,
        O(k)): the owner sends ``δ = θ_new - (1-lr·wd)·θ + u`` at its mask entries, coded like
        the payload, and keeps ``u ← δ - deq(q(δ))``; returns every owner's decoded updates,
        flat (``width`` apart), for every rank to add to its decayed θ."""
        k_own, rank = own_idx.numel(), self.comm.rank
        u = self.state.update_residual
        if k_own:
            shard[:k_own] = theta_c.sub_(decayed_c).add_(u.index_select(0, own_idx))
        applied = all_gather_rows(shard, self.comm, self.codec, kind="params")
        if self.record:
            self.last["update_target"] = shard[:k_own].clone()
            self.last["update_sent"] = applied[rank, :k_own].clone()
        if k_own:
            u.index_copy_(0, own_idx, shard[:k_own].sub_(applied[rank, :k_own]))
        return applied.reshape(-1)

    def _update_passes(self, lib, idx: torch.Tensor, seg_counts: list[list[int]],
                       counts: list[int], starts: list[int], width: int, lr: float, step: int,
                       during_payload) -> tuple[dict, object]:
        """:meth:`update` with its O(k) passes in Triton (the payload gathered straight
        into the reduce-scatter's rows; ĝ and ρ's fold, AdamS into the shard, the parameters
        from the gathered shards with the weight decay in the same walk of θ, the momentum);
        the collectives as in torch."""
        cfg, x, comm, m = self.cfg, self._x, self.comm, self.state.m
        world, rank, lo = comm.world, comm.rank, self.lo
        k_own, s_own = counts[rank], starts[rank]
        own = idx[s_own:s_own + k_own]
        send = torch.zeros(world, width, dtype=torch.float32, device=x.device)
        cut = 0.0
        for r, k in enumerate(counts):   # the payload rows, and ε = (1-M)⊙x in one pass
            if k:
                cut = cut + lib.take(idx[starts[r]:starts[r] + k], x, send[r])
        m_old = torch.empty(k_own, dtype=torch.float32, device=x.device)  # old m at the mask
        recv = torch.empty(width, dtype=torch.float32, device=x.device)
        overlapped = _overlapped(comm.reduce_scatter(recv, send.view(-1), kind="payload",
                                                     average=True, async_op=True),
                                 during_payload)
        del send
        ghat = recv[:k_own]     # recv = ĝ; ρ = (1-M)⊙base; m gathered into m_old
        sq = lib.ghat(ghat, m_old, cfg.betas[0], idx=own, base=lo, rho=self.state.rho, m=m)
        sq_t = sq.float().reshape(1)
        comm.all_reduce(sq_t, kind="norm", average=False)
        norm = sq_t.sqrt()[0]
        coef = clip_coef(norm, cfg.clip_grad) if cfg.clip_grad > 0 else None
        x_sq, self._x_sq = self._x_sq, None
        res = torch.linalg.vector_norm(x).double() if x_sq is None else _root(x_sq, cut)
        mi = self._index(idx, seg_counts)
        shard = torch.zeros(width, dtype=torch.float32, device=x.device)
        if k_own:     # θ·(1 - lr·wd) + the update into the shard; θ itself is not written yet
            lib.adams(idx, s_own, lo, ghat, m_old, m, self._pidx_own,
                      self._segments(mi, s_own, s_own + k_own, lr), self._adams_step(lr, step),
                      coef, out=shard)                         # and m (own range)
        elif self._pidx_own is None:
            m.zero_()
        else:
            m.index_fill_(0, self._pidx_own, 0.0)
        gathered = torch.empty(width * world, dtype=torch.float32, device=x.device)
        comm.all_gather(gathered, shard, kind="params")

        # θ from the gathered shards at the mask, θ·(1 - lr·wd) elsewhere: one walk of θ
        lib.scatter_params(idx, self._segments(mi, 0, idx.numel(), lr,
                                               lambda a: _gathered_at(a, starts, counts, width)),
                           gathered)
        self._decay_empty(mi, lr)
        self._pidx, self._pidx_own = idx, own - lo
        self._prev_local = mi
        self._x = None
        return {"grad_norm": norm, "scape/payload_numel": float(sum(counts)),
                "scape/residual_norm": res}, overlapped

    def forget_support(self) -> None:
        self._pidx = self._pidx_own = None
