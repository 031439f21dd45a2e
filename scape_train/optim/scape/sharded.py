"""SCAPE with ZeRO-1 sharded state (spec §3), equal to the replicated mode up to rounding.

Only the owner of a flat range stores its momentum ``m`` and the rank-independent residual ``ρ``;
every rank keeps its own full-size residual ``ε^(r)`` (the part that depends on its gradient):

    x^(r) = (1-β1)·g^(r) + ε^(r);      ε^(r) ← (1-M) ⊙ x^(r)               prepare()
    S     = reduce_scatter_avg(x^(r)[M], split by owner)                   kind ``payload``
    owner: base = β1·m + ρ;  b̄ = S + base[M];  ρ ← (1-M) ⊙ base;  ĝ, clip, AdamS as §2
    owner: statistic = base + x^(o) = c^(o)
    θ: everyone applies (1 - lr·wd) off the mask; owners all-gather their new values at the mask
       positions (kind ``params``) -- k values, never a dense parameter all-gather.

Owners' payload pieces have different lengths (the mask's popcount per owned range): both the
reduce-scatter and the all-gather pad every piece to the largest; the padding is counted as sent.
The clipping norm needs one scalar all-reduce (kind ``norm``). Every size (pieces, padding) follows
from the per-segment counts the density schedule fixes in advance: the step reads nothing back from
the device.
"""

from __future__ import annotations

import torch

from ..adams import adams_update_
from scape_train.comm import Comm
from ..config import OptimizerConfig
from .kernels import gather_masked, scatter_masked
from .masks import Mask
from .partition import ParamLayout, PartitionMap
from .payload import PayloadCodec, all_gather_rows, reduce_scatter_mean
from .passes import clip_coef
from .residual import ResidualStore
from .state import ScapeState


class ShardedScape:
    mode = "sharded"

    def __init__(self, layout: ParamLayout, part: PartitionMap, cfg: OptimizerConfig, comm: Comm):
        self.layout, self.part, self.cfg, self.comm = layout, part, cfg, comm
        dev = layout.device
        self.lo, self.hi = part.ranges[comm.rank]
        own = self.hi - self.lo
        self.codec = PayloadCodec(cfg.payload_dtype)
        self.state = ScapeState(
            m=torch.zeros(own, dtype=torch.float32, device=dev),       # the owner's range
            residual=ResidualStore(layout.total, dev, cfg.offload_residuals,
                                   cfg.offload_chunk_numel),           # ε^(r), full size
            rho=torch.zeros(own, dtype=torch.float32, device=dev),
            # low precision only: the owner's parameter-update residual (_sync_param_updates)
            update_residual=(torch.zeros(own, dtype=torch.float32, device=dev)
                             if self.codec.lowp else None))
        self.record = False
        self.last: dict[str, torch.Tensor] = {}
        self._x: torch.Tensor | None = None
        self._res_sq = torch.zeros((), dtype=torch.float64, device=dev)

    def prepare(self, g: torch.Tensor, mask: Mask | None, counts=None) -> torch.Tensor:
        """``x = (1-β1)·g``, the residual folded when ``mask`` is known; returns ``c^(o)``.
        ``counts``: as in the replicated engine, not needed here."""
        x = torch.mul(g, 1.0 - self.cfg.betas[0])
        self._res_sq = self.state.residual.fold(x, None if mask is None else mask.dense())
        self._x = x
        return self._base().add_(x[self.lo:self.hi])                  # = c^(o) on the own range

    def finish_residual(self, mask: Mask) -> None:
        assert self._x is not None
        self._res_sq = self.state.residual.set_from(self._x, mask.dense())

    def _base(self) -> torch.Tensor:
        return torch.mul(self.state.m, self.cfg.betas[0]).add_(self.state.rho)

    def update(self, mask: Mask, lr: float, step: int, seg_counts: list[list[int]],
               during_payload=None) -> tuple[dict, None]:
        """``seg_counts``: the mask's ones per segment of every rank, known on the host (the
        density schedule): every size below follows from it, none is read from the device.
        Returns the metrics and what ``during_payload`` (work to overlap with the payload's
        collective) returned: ``None`` here, where it is not run (the caller runs it after)."""
        bits = mask.dense()     # M_t's bool tensor: the reference reads the mask whole
        cfg, x, comm, lay = self.cfg, self._x, self.comm, self.layout
        assert x is not None, "prepare() first"
        beta1, beta2 = cfg.betas
        world, rank = comm.world, comm.rank
        if self.record:
            self.last = {"x": x.clone()}
        counts = [sum(c) for c in seg_counts]
        width = max(1, max(counts))
        # Payload: this rank's x at every mask position, in flat order = owner order; pad each
        # owner's piece to ``width`` so one reduce-scatter hands each owner its piece.
        payload = gather_masked(x, bits, count=sum(counts))
        send = torch.zeros(world * width, dtype=torch.float32, device=x.device)
        start = 0
        for r, k in enumerate(counts):
            send[r * width: r * width + k] = payload[start:start + k]
            start += k
        if self.codec.lowp:
            # all-to-all of the coded pieces, fp32 mean on the owner; this rank's quantization
            # error (exact) goes back into its residual ε at the same mask positions
            recv, sent = reduce_scatter_mean(send.view(world, width), comm, self.codec,
                                             kind="payload")
            err = send.view(world, width).sub_(sent)
            err_c = torch.cat([err[r, :k] for r, k in enumerate(counts)])
            self._res_sq = self._res_sq + self.state.residual.set_masked(
                err_c, bits, err_c.numel())
            if self.record:
                self.last["wire_error"] = err_c.clone()
        else:
            recv = torch.empty(width, dtype=torch.float32, device=x.device)
            comm.reduce_scatter(recv, send, kind="payload", average=True)
        if self.record:
            self.last["reduced"] = recv[:counts[rank]].clone()
        k_own = counts[rank]
        own_mask = bits[self.lo:self.hi]
        base = self._base()
        b_c = recv[:k_own].add_(gather_masked(base, own_mask, count=k_own))
        ghat_c = gather_masked(self.state.m, own_mask, count=k_own)
        ghat_c.mul_(-beta1).add_(b_c).div_(1.0 - beta1)
        sq = ghat_c.double().square().sum().float().reshape(1)
        comm.all_reduce(sq, kind="norm", average=False)
        norm = sq.sqrt()[0]
        if cfg.clip_grad > 0:
            ghat_c.mul_(clip_coef(norm, cfg.clip_grad))
        self.state.rho = base.masked_fill_(own_mask, 0.0)
        ghat = torch.zeros_like(self.state.m)
        scatter_masked(ghat_c, own_mask, ghat, count=k_own)
        decayed = self._decayed_own(lr) if self.codec.lowp else None
        for seg in self.part.segments[rank]:
            a = seg.flat_start - self.lo
            sl = slice(a, a + seg.numel)
            adams_update_(lay.flat_view(seg.tensor)[seg.start:seg.end], self.state.m[sl],
                          ghat[sl],
                          step=step, lr=lr, beta1=beta1, beta2=beta2, eps=cfg.eps,
                          weight_decay=lay.weight_decay[seg.tensor],
                          bias_correction=cfg.bias_correction, mask=own_mask[sl])
        if self.codec.lowp:
            self._sync_param_updates(bits, lr, counts, seg_counts, width, decayed)
        else:
            self._sync_params(bits, lr, counts, seg_counts, width)
        self._x = None
        return {"grad_norm": norm, "scape/payload_numel": float(payload.numel()),
                "scape/residual_norm": self._res_sq.sqrt()}, None

    def _sync_params(self, mask: torch.Tensor, lr: float, counts: list[int],
                     seg_counts: list[list[int]], width: int) -> None:
        lay, rank = self.layout, self.comm.rank
        own = [lay.flat_view(s.tensor)[s.start:s.end] for s in self.part.segments[rank]]
        shard = torch.zeros(width, dtype=torch.float32, device=lay.device)
        if own:
            vals = gather_masked(torch.cat(own), mask[self.lo:self.hi],
                                 count=counts[rank])
            shard[:vals.numel()] = vals
        gathered = torch.empty(width * self.comm.world, dtype=torch.float32, device=lay.device)
        self.comm.all_gather(gathered, shard, kind="params")
        for r, segs in enumerate(self.part.segments):
            if r == rank:
                continue
            at = r * width
            for seg, k in zip(segs, seg_counts[r]):
                view = lay.flat_view(seg.tensor)[seg.start:seg.end]
                wd = lay.weight_decay[seg.tensor]
                if wd != 0.0:
                    view.mul_(1.0 - lr * wd)   # off-mask coordinates: weight decay only
                m = mask[seg.flat_start:seg.flat_start + seg.numel]
                scatter_masked(gathered[at:at + k], m, view, count=k)
                at += k

    # -- low-precision parameter sync ----------------------------------------------------------
    def _own_values(self) -> torch.Tensor:
        lay = self.layout
        own = [lay.flat_view(s.tensor)[s.start:s.end] for s in self.part.segments[self.comm.rank]]
        return torch.cat(own) if own else torch.zeros(0, dtype=torch.float32, device=lay.device)

    def _decayed_own(self, lr: float) -> torch.Tensor:
        """``(1 - lr·wd)·θ`` on the own range, by the very op every other rank applies."""
        dec = self._own_values()
        for seg in self.part.segments[self.comm.rank]:
            wd = self.layout.weight_decay[seg.tensor]
            if wd != 0.0:
                a = seg.flat_start - self.lo
                dec[a:a + seg.numel].mul_(1.0 - lr * wd)
        return dec

    def _sync_param_updates(self, mask: torch.Tensor, lr: float, counts: list[int],
                            seg_counts: list[list[int]], width: int,
                            decayed: torch.Tensor) -> None:
        """Low-precision parameter sync: the owner sends its UPDATES at the mask positions,
        ``δ = θ_new - (1-lr·wd)·θ`` plus its update residual ``u``, coded like the payload, and
        keeps ``u ← δ + u - deq(q(δ + u))`` (error feedback on the parameters: the applied
        updates never drift from the exact ones by more than one quantization error). EVERY
        rank, the owner included, then sets ``θ ← (1-lr·wd)·θ`` and adds the decoded updates at
        the mask positions, with the same ops on the same bytes: the parameters stay
        bit-identical on all ranks. (Sending the new values themselves in bf16/fp8 would round
        θ to 8 or 3 mantissa bits: the update would drown.)"""
        lay, rank = self.layout, self.comm.rank
        own_mask = mask[self.lo:self.hi]
        k_own = counts[rank]
        shard = torch.zeros(width, dtype=torch.float32, device=lay.device)
        if k_own:
            delta = (gather_masked(self._own_values(), own_mask, count=k_own)
                     .sub_(gather_masked(decayed, own_mask, count=k_own))
                     .add_(gather_masked(self.state.update_residual, own_mask,
                                         count=k_own)))
            shard[:k_own] = delta
        applied = all_gather_rows(shard, self.comm, self.codec, kind="params")
        if self.record:
            self.last["update_target"] = shard[:k_own].clone()
        if k_own:
            scatter_masked(shard[:k_own].sub_(applied[rank, :k_own]), own_mask,
                           self.state.update_residual, count=k_own)
        if self.record:
            self.last["update_sent"] = applied[rank, :k_own].clone()
        # the owner's parameters back to (1-lr·wd)·θ, then the common path
        at = 0
        for seg in self.part.segments[rank]:
            lay.flat_view(seg.tensor)[seg.start:seg.end].copy_(decayed[at:at + seg.numel])
            at += seg.numel
        for r, segs in enumerate(self.part.segments):
            at = 0
            for seg, k in zip(segs, seg_counts[r]):
                view = lay.flat_view(seg.tensor)[seg.start:seg.end]
                wd = lay.weight_decay[seg.tensor]
                if r != rank and wd != 0.0:
                    view.mul_(1.0 - lr * wd)
                m = mask[seg.flat_start:seg.flat_start + seg.numel]
                vals = gather_masked(view, m, count=k).add_(
                    applied[r, at:at + k])
                scatter_masked(vals, m, view, count=k)
                at += k

    def finish_step(self) -> dict[str, torch.Tensor]:
        """End of the step, after the next mask's top-k: nothing left to do (the residual was
        folded by prepare() or finish_residual())."""
        return {}

    # -- state in model space ------------------------------------------------------------------
    def _gather_owned(self, t: torch.Tensor) -> torch.Tensor:
        """The full flat tensor from every owner's range (checkpoint time only)."""
        lengths = [hi - lo for lo, hi in self.part.ranges]
        width = max(1, max(lengths))
        shard = torch.zeros(width, dtype=t.dtype, device=t.device)
        shard[:t.numel()] = t
        out = torch.empty(width * self.comm.world, dtype=t.dtype, device=t.device)
        self.comm.all_gather(out, shard, kind="checkpoint")
        return torch.cat([out[r * width: r * width + n] for r, n in enumerate(lengths)])

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full flat state, gathered from the owners (tests and the in-memory ``state_dict``
        only: checkpoints write each owner's range instead, see :meth:`checkpoint_tensors`)."""
        st = self.state
        out = {"momentum": self._gather_owned(st.m), "shared_residual": self._gather_owned(st.rho),
               "residual": st.residual.full()}
        if self.state.update_residual is not None:
            out["update_residual"] = self._gather_owned(self.state.update_residual)
        return out

    def load_update_residual(self, owned: torch.Tensor | None) -> None:
        """The owner's parameter-update residual over its range (low-precision payloads);
        None: zero."""
        if self.state.update_residual is not None:
            if owned is None:
                self.state.update_residual.zero_()
            else:
                self.state.update_residual.copy_(owned)

    @property
    def state_range(self) -> tuple[int, int]:
        """The flat range of ``m`` and ``ρ`` this rank owns."""
        return self.lo, self.hi

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live state by kind, not copied and never gathered: ``m`` and ``ρ`` over the owned
        range (owner-sharded), the full-size ``ε`` of this rank (per rank)."""
        sharded = {"momentum": self.state.m, "shared_residual": self.state.rho}
        if self.state.update_residual is not None:   # low-precision payloads: owner-range state
            sharded["update_residual"] = self.state.update_residual
        return {"replicated": {}, "sharded": sharded,
                "per_rank": {"residual": self.state.residual.tensor()}}

    def load_range_state(self, momentum: torch.Tensor, shared: torch.Tensor | None,
                         residual: torch.Tensor | None) -> None:
        """``momentum`` and ``shared`` over the owned range; ``residual`` full, or None to reset."""
        self.state.m.copy_(momentum)
        if shared is not None:
            self.state.rho.copy_(shared)
        else:                         # from a replicated checkpoint: ρ = 0, ε = e
            self.state.rho.zero_()
        if residual is not None:
            self.state.residual.load(residual)
        else:
            self.state.residual.zero_()
