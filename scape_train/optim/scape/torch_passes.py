"""SCAPE's passes as torch ops: the CPU path, the CUDA fallback (``use_triton: off``, a
low-precision payload) and the oracle the Triton passes (:mod:`.triton_passes`) are tested
against. The same methods with the same arguments, chosen once by
:func:`.strategy.select_passes`: the fused step's passes, and the masks' packing and codecs
(:mod:`.kernels`, :mod:`.torch_codecs`).

Values: the reference engines' elementwise ops in their order on every coordinate, so the fused
step agrees with them bit for bit wherever torch's CPU kernels round alike (see :mod:`.fused`).
Sums of squares are taken in float64, as the kernels take them; a full-size one (the prepare's
Σ c²) is a read of the residual of its own here, where the kernels take it on the way.
"""

from __future__ import annotations

import torch

from ...host_to_device import upload
from . import kernels, torch_codecs
from ..adams_constants import AdamSConstants
from .passes import Clip, ParamSegment, clip_coef


def _sq(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x).double().square()


def _sq_k(x: torch.Tensor) -> torch.Tensor:
    return x.double().square().sum()


class TorchPasses:
    """SCAPE's passes in torch ops (see the module docstring); one per strategy."""

    # -- the masks: packed bits and the segment codecs (MaskPlan's) --------------------------
    pack_bits = staticmethod(kernels.pack_bits)
    unpack_bits = staticmethod(kernels.unpack_bits)
    encode_mask = staticmethod(torch_codecs.encode_mask)
    decode_mask = staticmethod(torch_codecs.decode_mask)
    topk_mask = staticmethod(kernels.topk_segments)

    def __init__(self):
        self._views_key: tuple | None = None
        self._views_cache: list[torch.Tensor] = []
        self._offsets: dict[tuple, torch.Tensor] = {}

    def _views(self, flat: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
        """Per-tensor views of a flat state tensor (cached: the state tensors are persistent;
        the cached views keep ``flat``, and so its id, alive)."""
        key = (id(flat), flat.numel())
        if self._views_key != key:
            self._views_cache = [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
            self._views_key = key
        return self._views_cache

    def _local(self, idx: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """The per-tensor indices of ``idx[a:b]`` for consecutive ``(a, b, tensor offset)``
        spans, in one subtraction: the offsets repeated per index are cached per span list (on
        the host per span, on the device per index: no k-sized host copy)."""
        offs = self._offsets.get(tuple(spans))
        if offs is None:
            if len(self._offsets) > 8:      # a density warm-up visits many plans
                self._offsets.clear()
            offs = torch.repeat_interleave(upload([o for _, _, o in spans], idx.device),
                                           upload([b - a for a, b, _ in spans], idx.device),
                                           output_size=spans[-1][1] - spans[0][0])
            self._offsets[tuple(spans)] = offs
        return idx[spans[0][0]:spans[-1][1]] - offs

    @staticmethod
    def decay(segs: list[ParamSegment], lr: float) -> None:
        """θ ← θ·dec on each segment's elements, where dec = 1 - lr·wd is not 1."""
        dec = [s for s in segs if s.decay(lr) != 1.0 and s.s1 > s.s0]
        if dec:
            torch._foreach_mul_([s.param[s.s0:s.s1] for s in dec], [s.decay(lr) for s in dec])

    def params_at(self, idx: torch.Tensor, segs: list[ParamSegment]) -> torch.Tensor:
        """θ at each segment's entries ``idx[a:b]``, as one tensor in index-list order."""
        if not segs:
            return torch.zeros(0, dtype=torch.float32, device=idx.device)
        local, a0 = self._local(idx, [(s.a, s.b, s.offset) for s in segs]), segs[0].a
        parts = [s.param.index_select(0, local[s.a - a0:s.b - a0]) for s in segs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # -- the passes -------------------------------------------------------------------------
    def prepare_general(self, grads: list[torch.Tensor], offsets: list[int], e: torch.Tensor,
                        m: torch.Tensor, beta1: float, s: float) -> torch.Tensor:
        """§2 line 1 where m may be nonzero anywhere: e ← (β1·m + s·g) + e; Σ c²."""
        w = torch._foreach_mul(self._views(m, offsets), beta1)
        torch._foreach_add_(w, grads, alpha=s)
        torch._foreach_add_(self._views(e, offsets), w)
        return _sq(e)

    def prepare(self, grads: list[torch.Tensor], offsets: list[int], e: torch.Tensor,
                m: torch.Tensor, pidx: torch.Tensor, support: list[tuple[int, int, int]],
                beta1: float, s: float) -> torch.Tensor:
        """§2 line 1 with m's support ``pidx`` known (``support``: its ``(tensor, a, b)``
        slices; e_{t-1} = 0 there): e ← s·g + e (the gradients scaled in place: consumed), then
        e[pidx] ← β1·m + s·g; Σ c²."""
        c_p = m.index_select(0, pidx).mul_(beta1)
        if support:
            local = self._local(pidx, [(a, b, offsets[t]) for t, a, b in support])
            g_at = [grads[t].index_select(0, local[a:b]) for t, a, b in support]
            c_p.add_(g_at[0] if len(g_at) == 1 else torch.cat(g_at), alpha=s)
        torch._foreach_mul_(grads, s)
        torch._foreach_add_(self._views(e, offsets), grads)
        e.index_copy_(0, pidx, c_p)
        return _sq(e)

    def prepare_sharded(self, grads: list[torch.Tensor], offsets: list[int], x: torch.Tensor,
                        rho: torch.Tensor, m: torch.Tensor, pidx_own: torch.Tensor | None,
                        lo: int, hi: int, cand: torch.Tensor, beta1: float, s: float
                        ) -> torch.Tensor:
        """§3's prepare: x ← s·g + x, ρ ← β1·m + ρ (``pidx_own``: m's support on the own
        range, where ρ = 0: ρ ← β1·m there), cand = ρ + x on the own range; Σ x²."""
        torch._foreach_mul_(grads, s)
        torch._foreach_add_(self._views(x, offsets), grads)
        if pidx_own is None:
            rho.copy_(torch.mul(m, beta1).add_(rho))
        else:
            rho.index_copy_(0, pidx_own, m.index_select(0, pidx_own).mul_(beta1))
        torch.add(rho, x[lo:hi], out=cand)
        return _sq(x)

    def gather(self, idx: torch.Tensor, src: torch.Tensor, out: torch.Tensor, base: int = 0
               ) -> torch.Tensor:
        """out ← src[idx - base]; Σ out²."""
        out.copy_(src.index_select(0, idx - base if base else idx))
        return _sq_k(out)

    def take(self, idx: torch.Tensor, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out ← src[idx], then src[idx] ← 0; Σ out²."""
        sq = self.gather(idx, src, out)
        src.index_fill_(0, idx, 0.0)
        return sq

    def ghat(self, b: torch.Tensor, m_old: torch.Tensor, beta1: float, *,
             idx: torch.Tensor | None = None, base: int = 0, rho: torch.Tensor | None = None,
             m: torch.Tensor | None = None) -> torch.Tensor:
        """ĝ = (b (+ ρ[idx - base], then ρ ← 0 there) - β1·m_old) / (1-β1) in place of b; with
        ``m``, m_old ← m[idx - base] first; Σ ĝ²."""
        i = None if idx is None else (idx - base if base else idx)
        if m is not None:
            m_old.copy_(m.index_select(0, i))
        if rho is not None:
            b.add_(rho.index_select(0, i))
            rho.index_fill_(0, i, 0.0)
        torch.div(m_old.mul(-beta1).add_(b), 1.0 - beta1, out=b)
        return _sq_k(b)

    def adams(self, idx: torch.Tensor, j0: int, base: int, ghat: torch.Tensor,
              m_old: torch.Tensor, m: torch.Tensor, old_support: torch.Tensor | None,
              segs: list[ParamSegment], hp: AdamSConstants, clip: Clip | None,
              out: torch.Tensor | None = None) -> None:
        """§2 lines 5-7 at the mask entries ``idx[j0:j0 + k]``, ``adams_update_``'s ops on the
        gathered values (see :meth:`.triton_passes.TritonPasses.adams`); ``m_old`` is
        overwritten."""
        k = ghat.numel()
        g = ghat if clip is None else ghat * clip_coef(*clip)
        if out is None:
            self.decay(segs, hp.lr)    # θ·dec first, as adams_update_ orders it
        theta = self.params_at(idx, segs)
        if out is not None:
            for s in segs:
                if s.decay(hp.lr) != 1.0:
                    theta[s.a - j0:s.b - j0].mul_(s.decay(hp.lr))
        prev = m_old / hp.bc1 if hp.bias_correction == "official" else m_old
        v = prev.square().mul_(hp.beta2).addcmul_(g, g, value=1.0 - hp.beta2)
        m_new = m_old.mul_(hp.beta1).add_(g, alpha=1.0 - hp.beta1)
        denom = v.sqrt_()
        if hp.bias_correction == "adam":
            denom.div_(hp.sqrt_bc2)
        theta.addcdiv_(m_new, denom.add_(hp.eps), value=-hp.step_size)
        if out is None:
            self.write_params(idx, segs, [theta[s.a - j0:s.b - j0] for s in segs])
        else:
            out[:k].copy_(theta)
        if old_support is None:
            m.zero_()
        else:
            m.index_fill_(0, old_support, 0.0)
        own = idx[j0:j0 + k]
        m.index_copy_(0, own - base if base else own, m_new)

    def scatter_params(self, idx: torch.Tensor, segs: list[ParamSegment], values: torch.Tensor,
                       lr: float) -> None:
        """θ ← θ·dec on the segments, then θ[idx[a:b]] ← values[src:src + b - a] for each."""
        self.decay(segs, lr)
        self.write_params(idx, segs, [values[s.src:s.src + s.b - s.a] for s in segs])

    def write_params(self, idx: torch.Tensor, segs: list[ParamSegment],
                      pieces: list[torch.Tensor]) -> None:
        """θ[idx[a:b]] ← each segment's piece."""
        if segs:
            local, a0 = self._local(idx, [(s.a, s.b, s.offset) for s in segs]), segs[0].a
            for s, piece in zip(segs, pieces):
                s.param.index_copy_(0, local[s.a - a0:s.b - a0], piece)

    def count_common(self, a: torch.Tensor, b: torch.Tensor | None, bits: torch.Tensor
                     ) -> torch.Tensor:
        """How many of the indices ``a`` are among ``b`` (``b`` None: those whose bit is set in
        the packed bitmap ``bits``); an int64 tensor. A transient bool map for ``b`` (an
        index_put of bits with accumulate, ORing into bytes, is several times slower on the
        CPU)."""
        if b is None:
            byte = bits.index_select(0, a >> 3).to(torch.int64)
            return ((byte >> (a & 7)) & 1).sum()
        seen = torch.zeros(bits.numel() * 8, dtype=torch.bool, device=a.device)
        return torch.count_nonzero(seen.index_fill_(0, b, True).index_select(0, a))
