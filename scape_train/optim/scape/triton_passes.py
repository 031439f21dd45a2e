"""SCAPE's passes as Triton kernels (CUDA), chosen by :func:`.strategy.select_passes`: the fused
step's passes here, the masks' packing and codecs in :mod:`.triton_codecs`.

Every method takes tensors (contiguous fp32 values, int64 indices) and the host-known sizes
the density schedule gives; each call is counted as one pass by the active
``profiling.DeviceOpCounter`` s, with the bytes it reads and writes (each element once).

- **Nothing is read back to the host.** Sums (Σ c², Σ ĝ², ...) come back as 0-d float64 tensors
  on the device (per-program partial sums added by one ``sum``), and :meth:`TritonPasses.adams`
  takes the gradient norm as a device tensor and computes the clipping coefficient from it in
  the kernel. Grid sizes come from host-known counts.
- **One flat gradient**: the prepare reads the flat gradient buffer (``optimizer.flat_grads``,
  the default) as one tensor; autograd's own per-tensor gradients take the torch passes.
- **The parameters' segments in one launch**, as torch's multi-tensor apply does it: a device
  table of the parameters' addresses, beside a block table ``(row, first element[, end])`` so
  that no block straddles two tensors, built once per segment list (the engines keep a mask
  plan's lists); the table says which tensors decay, and the step's decay factor is a kernel
  argument, so a new learning rate uploads nothing.
- **Rounding as torch's**: ``enable_fp_fusion=False`` (no FMA contraction), ``div_rn``/
  ``sqrt_rn`` (correctly rounded, where Triton's ``/`` and ``sqrt`` are approximate on the GPU),
  sums of squares in float64 (in another order than torch's, so they agree to rounding).

Work per pass: the prepare is the one full-size pass (read g, e (and m on a general step),
write e); every other pass touches the k mask positions only, and the weight decay the
decayed segments' other elements. Tested against the fused engine's torch ops under
``TRITON_INTERPRET=1`` (tests/test_triton_passes.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...host_to_device import host_table, upload
from . import triton_codecs, triton_select
from .counted_launch import count, run
from ..adams_constants import AdamSConstants
from ..adams_triton import BIAS_CODES, adams_scalars, adams_values
from .passes import Clip, ParamSegment, flat_buffer

FULL_BLOCK = 4096      # elements per program of a full-size pass
K_BLOCK = 1024         # index-list entries per program of a k-sized pass
_OPTS = dict(enable_fp_fusion=False)


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _f32_at(table_entry):
    """A tensor's address from a device address table, as an fp32 pointer."""
    return table_entry.to(tl.pointer_type(tl.float32))


@triton.jit
def _sq_sum(x, keep):
    d = x.to(tl.float64)
    return tl.sum(tl.where(keep, d * d, 0.0), axis=0)


@triton.jit
def _prepare_kernel(n, g, e, m, parts, beta1, s, lo, hi, rho, cand, GENERAL: tl.constexpr,
                    CAND: tl.constexpr, BLOCK: tl.constexpr):
    """c = e + s·g (GENERAL: (β1·m + s·g) + e) over one block of the flat gradient; e ← c;
    Σ c² into ``parts``. CAND (sharded): on the own range [lo, hi) also cand[f - lo] = ρ[f - lo]
    + c. Triton sees the tensors 16-byte aligned, hence 16-byte loads and stores
    (scripts/triton_compile_check.py reads it in the PTX)."""
    pid = tl.program_id(0)
    f = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = f < n
    gv = tl.load(g + f, mask=keep, other=0.0)
    old = tl.load(e + f, mask=keep, other=0.0)
    if GENERAL:
        c = tl.load(m + f, mask=keep, other=0.0) * beta1 + s * gv
        c = c + old
    else:
        c = old + s * gv
    tl.store(e + f, c, mask=keep)
    if CAND:
        fo = f - lo
        own = keep & (fo >= 0) & (fo < hi - lo)
        r = tl.load(rho + fo, mask=own, other=0.0)
        tl.store(cand + fo, r + c, mask=own)
    tl.store(parts + pid, _sq_sum(c, keep))


@triton.jit
def _prepare_fix_kernel(k, pidx, g, e, m, parts, beta1, s, BLOCK: tl.constexpr):
    """At m's support (e_{t-1} = 0 there): e[i] ← β1·m[i] + s·g[i]; Σ (c² - old e²)."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(pidx + j, mask=keep, other=0)
    old = tl.load(e + i, mask=keep, other=0.0)
    c = tl.load(m + i, mask=keep, other=0.0) * beta1 + s * tl.load(g + i, mask=keep, other=0.0)
    tl.store(e + i, c, mask=keep)
    tl.store(parts + pid, _sq_sum(c, keep) - _sq_sum(old, keep))


@triton.jit
def _rho_kernel(pidx, k, rho, m, beta1, BLOCK: tl.constexpr):
    """ρ[i] ← β1·m[i] at the owner's m support."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(pidx + j, mask=keep, other=0)
    tl.store(rho + i, tl.load(m + i, mask=keep, other=0.0) * beta1, mask=keep)


@triton.jit
def _gather_kernel(k, idx, base, src, out, parts, TAKE: tl.constexpr, BLOCK: tl.constexpr):
    """out[j] = src[idx[j] - base] (TAKE: then src[...] = 0); Σ out²."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(idx + j, mask=keep, other=0) - base
    v = tl.load(src + i, mask=keep, other=0.0)
    tl.store(out + j, v, mask=keep)
    if TAKE:
        tl.store(src + i, tl.zeros_like(v), mask=keep)
    tl.store(parts + pid, _sq_sum(v, keep))


@triton.jit
def _ghat_kernel(k, idx, base, b, rho, m, m_old, parts, nb, d, HAS_RHO: tl.constexpr,
                 HAS_M: tl.constexpr, BLOCK: tl.constexpr):
    """ĝ = (m·(-β1) + b (+ ρ, then ρ ← 0)) / (1-β1) in place of b; m read at the mask and stored
    to m_old[j], the old momentum at the mask, for the AdamS pass; or (not HAS_M) read from
    m_old, where it was gathered; Σ ĝ²."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    t = tl.load(b + j, mask=keep, other=0.0)
    if HAS_RHO or HAS_M:
        i = tl.load(idx + j, mask=keep, other=0) - base
    if HAS_RHO:
        t = t + tl.load(rho + i, mask=keep, other=0.0)
        tl.store(rho + i, tl.zeros_like(t), mask=keep)
    if HAS_M:
        mv = tl.load(m + i, mask=keep, other=0.0)
        tl.store(m_old + j, mv, mask=keep)
    else:
        mv = tl.load(m_old + j, mask=keep, other=0.0)
    g = tl.div_rn(mv * nb + t, d)
    tl.store(b + j, g, mask=keep)
    tl.store(parts + pid, _sq_sum(g, keep))


@triton.jit
def _fill_kernel(dst, idx, k, value, BLOCK: tl.constexpr):
    """dst[idx] ← value."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(idx + j, mask=keep, other=0)
    tl.store(dst + i, tl.zeros((BLOCK,), tl.float32) + value, mask=keep)


@triton.jit
def _row_decay(row, dec):
    """A parameter-table row's decay factor: the step's ``dec`` where its last column says the
    tensor decays, else 1."""
    return tl.where(tl.load(row + 7) != 0, dec, 1.0)


@triton.jit
def _decay_kernel(blocks, param_table, dec, BLOCK: tl.constexpr):
    """θ ← θ·dec on one block of a segment's elements."""
    pid = tl.program_id(0)
    row = param_table + 8 * tl.load(blocks + 3 * pid)
    offs = tl.load(blocks + 3 * pid + 1) + tl.arange(0, BLOCK).to(tl.int64)
    keep = offs < tl.load(blocks + 3 * pid + 2)
    ptr = _f32_at(tl.load(row)) + offs
    tl.store(ptr, tl.load(ptr, mask=keep, other=0.0) * _row_decay(row, dec), mask=keep)


@triton.jit
def _adams_kernel(blocks, param_table, idx, j0, base, ghat, m, out, m_old, norm, max_norm, dec,
                  beta1, beta2, omb1, omb2, bc1, sqrt_bc2, eps, ns, CLIP: tl.constexpr,
                  HAS_OUT: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """AdamS at one segment block of the mask (:func:`..adams_triton.adams_values`): θ
    updated (the decay pass has run), or θ·dec + the update written to out; m[i] ← m'.
    ``m_old``: m at the mask, from the ĝ pass (before m was zeroed). CLIP: ĝ times
    ``passes.clip_coef(norm, max_norm)``, rounded as torch's ops round it (``+ 1e-6`` in
    float32, a reciprocal, a product, then at most 1)."""
    pid = tl.program_id(0)
    row = param_table + 8 * tl.load(blocks + 2 * pid)
    j = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK).to(tl.int64)
    keep = j < tl.load(row + 3)
    i = tl.load(idx + j, mask=keep, other=0)
    g = tl.load(ghat + (j - j0), mask=keep, other=0.0)
    if CLIP:
        coef = tl.div_rn(1.0, tl.load(norm) + 1e-6) * max_norm
        g = g * tl.where(coef > 1.0, 1.0, coef)
    mo = tl.load(m_old + (j - j0), mask=keep, other=0.0)
    mn, upd = adams_values(g, mo, beta1, beta2, omb1, omb2, bc1, sqrt_bc2, eps, ns, BIAS)
    th_ptr = _f32_at(tl.load(row)) + (i - tl.load(row + 1))
    th = tl.load(th_ptr, mask=keep, other=0.0)
    if HAS_OUT:
        tl.store(out + (j - j0), th * _row_decay(row, dec) + upd, mask=keep)
    else:
        tl.store(th_ptr, th + upd, mask=keep)
    tl.store(m + (i - base), mn, mask=keep)


@triton.jit
def _scatter_params_kernel(blocks, param_table, idx, values, BLOCK: tl.constexpr):
    """θ[idx[j] - off] ← values[src + j - a] on one segment block."""
    pid = tl.program_id(0)
    row = param_table + 8 * tl.load(blocks + 2 * pid)
    j = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK).to(tl.int64)
    keep = j < tl.load(row + 3)
    i = tl.load(idx + j, mask=keep, other=0)
    v = tl.load(values + (tl.load(row + 4) - tl.load(row + 2) + j), mask=keep)
    tl.store(_f32_at(tl.load(row)) + (i - tl.load(row + 1)), v, mask=keep)


@triton.jit
def _mark_bits_kernel(idx, k, words, BLOCK: tl.constexpr):
    """Set bit ``i`` of the packed bitmap (int32 words, little-endian: ``pack_bits``'s bytes) for
    every entry ``i`` of the index list (atomic: entries of one word lie in several programs'
    blocks)."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(idx + j, mask=keep, other=0)
    bit = tl.full((BLOCK,), 1, tl.int32) << (i & 31).to(tl.int32)
    tl.atomic_or(words + (i >> 5), bit, mask=keep, sem="relaxed")


@triton.jit
def _count_bits_kernel(idx, k, words, parts, BLOCK: tl.constexpr):
    """How many entries ``i`` of the index list have bit ``i`` set in the packed bitmap."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(idx + j, mask=keep, other=0)
    w = tl.load(words + (i >> 5), mask=keep, other=0)
    tl.store(parts + pid, tl.sum(((w >> (i & 31).to(tl.int32)) & 1).to(tl.int64), axis=0))


# ----------------------------------------------------------------------------------------------
# host side


def _decays(seg: ParamSegment) -> bool:
    """Whether the passes walk the segment's elements with the step's decay factor (a factor
    that rounds to 1 multiplies exactly: the walk does not depend on the learning rate)."""
    return seg.wd != 0.0 and seg.s1 > seg.s0


class _SegmentTables(NamedTuple):
    """What the kernels take of one segment list, built once per list: the parameter table
    (addresses, slices, whether the tensor decays), the k-sized passes' blocks, the decay
    pass's blocks (or None), the decayed elements, the one weight-decay coefficient, and the
    index-list entries."""
    params: torch.Tensor
    blocks: torch.Tensor
    decay_blocks: torch.Tensor | None
    decayed: int
    wd: float
    entries: int


class TritonPasses:
    """SCAPE's passes for tensors on ``device`` (see the module docstring)."""

    pack_bits = staticmethod(triton_codecs.pack_bits)
    unpack_bits = staticmethod(triton_codecs.unpack_bits)
    encode_mask = staticmethod(triton_codecs.encode_mask)
    decode_mask = staticmethod(triton_codecs.decode_mask)

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._tables: dict[tuple, torch.Tensor] = {}
        self._by_list: dict[int, tuple[list, _SegmentTables]] = {}

    def topk_mask(self, stat: torch.Tensor, segments: tuple[tuple[int, int, int], ...]
                  ) -> torch.Tensor:
        """The next mask's bits: every segment's top-k of ``|stat|`` in a fixed number of
        launches (:mod:`.triton_select`; its tables cached per segment list)."""
        plan = self._cached(("select", segments),
                            lambda: triton_select.SelectPlan(list(segments), self.device))
        return triton_select.topk_mask(plan, stat)

    # -- device tables ---------------------------------------------------------------------
    def _cached(self, key: tuple, build) -> torch.Tensor:
        hit = self._tables.get(key)
        if hit is None:
            if len(self._tables) > 64:    # gradient tables change with autograd's allocations
                self._tables.clear()
            hit = self._tables[key] = build()
        return hit

    def _table(self, rows: list[tuple[int, ...]]) -> torch.Tensor:
        """An int64 table on the device (cached by its content)."""
        key = ("table", tuple(rows))
        return self._cached(key, lambda: upload([v for r in rows for v in r], self.device))

    def _blocks(self, starts: list[int], ends: list[int], block: int, with_end: bool
                ) -> torch.Tensor:
        """Rows ``(row, first element[, end])`` of the programs covering each ``[start, end)``
        with ``block`` elements each (cached by the ranges: they follow from the mask plan or
        the parameter sizes, not from the data)."""
        def build():
            a, b = host_table(starts), host_table(ends)
            per = (b - a + block - 1).div(block, rounding_mode="floor").clamp_min(0)
            row = torch.repeat_interleave(torch.arange(len(starts)), per)
            first = torch.cumsum(per, 0) - per
            at = a[row] + (torch.arange(row.numel()) - first[row]) * block
            cols = [row, at] + ([b[row]] if with_end else [])
            return upload(torch.stack(cols, 1).reshape(-1), self.device)
        return self._cached(("blocks", block, with_end, tuple(starts), tuple(ends)), build)

    def _segment_tables(self, segs: list[ParamSegment]) -> _SegmentTables:
        """``segs``' tables, looked up by the list itself (the engines build a mask plan's
        segment lists once and pass the same lists every step), else built from its content."""
        hit = self._by_list.get(id(segs))
        if hit is not None and hit[0] is segs:
            return hit[1]
        wds = {s.wd for s in segs if s.wd != 0.0}
        if len(wds) > 1:
            raise ValueError(f"the Triton passes take one weight-decay coefficient per step, "
                             f"got {sorted(wds)}; use optimizer.use_triton=off")
        dec = [s for s in segs if _decays(s)]
        tables = _SegmentTables(
            self._table([(s.param.data_ptr(), s.offset, s.a, s.b, s.src, s.s0, s.s1,
                          int(_decays(s))) for s in segs]),
            self._blocks([s.a for s in segs], [s.b for s in segs], K_BLOCK, False),
            # rows index the whole table: the other segments' ranges are empty
            self._blocks([s.s0 for s in segs], [s.s1 if _decays(s) else s.s0 for s in segs],
                         FULL_BLOCK, True) if dec else None,
            sum(s.s1 - s.s0 for s in dec), wds.pop() if wds else 0.0,
            sum(s.b - s.a for s in segs))
        if len(self._by_list) > 16:       # a density warm-up visits many plans
            self._by_list.clear()
        self._by_list[id(segs)] = (segs, tables)
        return tables

    def _parts(self, n: int, dtype=torch.float64) -> torch.Tensor:
        """Per-program partial sums, each written by its program (none: one zero)."""
        if not n:
            return torch.zeros(1, dtype=dtype, device=self.device)
        return torch.empty(n, dtype=dtype, device=self.device)

    # -- launch helpers -------------------------------------------------------------------
    def _over_k(self, k: int, launch, dtype=torch.float64, sums: bool = True, parts=None):
        """A pass over ``k`` index-list entries as ``launch(first, n, parts)`` calls: the whole
        blocks in one (n a multiple of the block, which Triton specializes as divisible by 16,
        so the mask is uniform over each thread's run and aligned streams load 16 bytes at a
        time), the tail block in another. Per-block partial sums in block order, as one
        launch would leave them; returns their sum (``sums=False``: a pass without any;
        ``parts``: the caller's ``cdiv(k, K_BLOCK)`` of them, which it sums)."""
        own = parts is None and sums
        if own:
            parts = self._parts(triton.cdiv(k, K_BLOCK), dtype)
        main = k - k % K_BLOCK
        if main:
            launch(0, main, parts)
        if k > main:
            launch(main, k - main, None if parts is None else parts[main // K_BLOCK:])
        return parts.sum() if own else None

    def _gather(self, idx, src, out, base: int = 0, take: bool = False) -> torch.Tensor:
        def launch(a, n, parts):
            run(_gather_kernel, (triton.cdiv(n, K_BLOCK),), n, idx[a:], base, src, out[a:],
                parts, TAKE=take, BLOCK=K_BLOCK)
        return self._over_k(idx.numel(), launch)

    def _fill(self, dst: torch.Tensor, idx: torch.Tensor, value: float) -> None:
        def launch(a, n, _parts):
            run(_fill_kernel, (triton.cdiv(n, K_BLOCK),), dst, idx[a:], n, value, BLOCK=K_BLOCK)
        self._over_k(idx.numel(), launch, sums=False)

    def _decay(self, tables: _SegmentTables, dec: float) -> None:
        """θ·dec over the decaying segments' elements ``[s0, s1)``: one full-size launch (a
        coalesced pass costs less than a gap loop per lane)."""
        if tables.decay_blocks is not None:
            run(_decay_kernel, (tables.decay_blocks.numel() // 3,), tables.decay_blocks,
                tables.params, dec, BLOCK=FULL_BLOCK, **_OPTS)

    def _prepare(self, g, e, s, *, m=None, beta1=0.0, lo=0, hi=0, rho=None, cand=None,
                 parts=None) -> torch.Tensor | None:
        """One launch of the full-size prepare over the flat gradient ``g``; returns Σ c²
        (``parts``: the caller's per-block sums, which it sums)."""
        nblk = triton.cdiv(g.numel(), FULL_BLOCK)
        own = parts is None
        if own:
            parts = self._parts(nblk)
        if nblk:         # unused pointers stand in for absent ones
            run(_prepare_kernel, (nblk,), g.numel(), g, e, e if m is None else m, parts, beta1,
                s, lo, hi, e if rho is None else rho, e if cand is None else cand,
                GENERAL=m is not None, CAND=cand is not None, BLOCK=FULL_BLOCK, **_OPTS)
        return parts.sum() if own else None

    @staticmethod
    def _flat(grads: list[torch.Tensor], offsets: list[int]) -> torch.Tensor:
        flat = flat_buffer(grads, offsets)
        assert flat is not None, "the Triton passes read one flat gradient (flat_grads)"
        return flat

    # -- the passes -------------------------------------------------------------------------
    def prepare_general(self, grads: list[torch.Tensor], offsets: list[int], e: torch.Tensor,
                        m: torch.Tensor, beta1: float, s: float) -> torch.Tensor:
        """§2 line 1 where m may be nonzero anywhere: e ← β1·m + s·g + e; Σ c²."""
        count("prepare_general", 16 * offsets[-1])
        return self._prepare(self._flat(grads, offsets), e, s, m=m, beta1=beta1)

    def prepare(self, grads: list[torch.Tensor], offsets: list[int], e: torch.Tensor,
                m: torch.Tensor, pidx: torch.Tensor, support: list[tuple[int, int, int]],
                beta1: float, s: float) -> torch.Tensor:
        """§2 line 1 with m's support ``pidx`` known (e_{t-1} = 0 there): e ← s·g + e, then
        e[pidx] ← β1·m + s·g; Σ c²."""
        count("prepare", 12 * offsets[-1] + 24 * pidx.numel())
        g = self._flat(grads, offsets)
        nblk = triton.cdiv(g.numel(), FULL_BLOCK)
        parts = self._parts(nblk + triton.cdiv(pidx.numel(), K_BLOCK))   # both launches' sums
        self._prepare(g, e, s, parts=parts[:nblk])

        def launch(a, n, fix_parts):
            run(_prepare_fix_kernel, (triton.cdiv(n, K_BLOCK),), n, pidx[a:], g, e, m,
                fix_parts, beta1, s, BLOCK=K_BLOCK, **_OPTS)
        self._over_k(pidx.numel(), launch, parts=parts[nblk:])
        return parts.sum()

    def prepare_sharded(self, grads: list[torch.Tensor], offsets: list[int], x: torch.Tensor,
                        rho: torch.Tensor, m: torch.Tensor, pidx_own: torch.Tensor, lo: int,
                        hi: int, cand: torch.Tensor, beta1: float, s: float) -> torch.Tensor:
        """§3's prepare: ρ ← β1·m at the owner's m support (ρ = 0 elsewhere there), x ← s·g + x,
        cand = ρ + x on the own range; Σ x²."""
        kp = pidx_own.numel()
        count("prepare_sharded", 12 * offsets[-1] + 8 * (hi - lo) + 16 * kp)

        def launch(a, n, _parts):
            run(_rho_kernel, (triton.cdiv(n, K_BLOCK),), pidx_own[a:], n, rho, m, beta1,
                BLOCK=K_BLOCK, **_OPTS)
        self._over_k(kp, launch, sums=False)        # first: the candidate reads ρ
        return self._prepare(self._flat(grads, offsets), x, s, lo=lo, hi=hi, rho=rho, cand=cand)

    def gather(self, idx: torch.Tensor, src: torch.Tensor, out: torch.Tensor, base: int = 0
               ) -> torch.Tensor:
        """out ← src[idx - base]; Σ out²."""
        count("gather", 16 * idx.numel())
        return self._gather(idx, src, out, base)

    def take(self, idx: torch.Tensor, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out ← src[idx], then src[idx] ← 0; Σ out²."""
        count("take", 20 * idx.numel())
        return self._gather(idx, src, out, take=True)

    def ghat(self, b: torch.Tensor, m_old: torch.Tensor, beta1: float, *,
             idx: torch.Tensor | None = None, base: int = 0, rho: torch.Tensor | None = None,
             m: torch.Tensor | None = None) -> torch.Tensor:
        """§2 line 4 / §3 line 6 on the k reduced values ``b``, in place: ĝ = (b (+ ρ[idx - base],
        then ρ ← 0 there) - β1·m_old) / (1-β1); with ``m``, m_old ← m[idx - base] first (the
        old momentum at the mask, for :meth:`adams`); Σ ĝ²."""
        k = b.numel()
        count("ghat", k * (12 + (8 if m is not None or rho is not None else 0)
                            + (4 if m is not None else 0) + (8 if rho is not None else 0)))

        def launch(a, n, parts):
            run(_ghat_kernel, (triton.cdiv(n, K_BLOCK),), n, b if idx is None else idx[a:],
                base, b[a:], b if rho is None else rho, b if m is None else m, m_old[a:], parts,
                -beta1, 1.0 - beta1, HAS_RHO=rho is not None, HAS_M=m is not None,
                BLOCK=K_BLOCK, **_OPTS)
        return self._over_k(k, launch)

    def adams(self, idx: torch.Tensor, j0: int, base: int, ghat: torch.Tensor,
              m_old: torch.Tensor, m: torch.Tensor, old_support: torch.Tensor | None,
              segs: list[ParamSegment], hp: AdamSConstants, clip: Clip | None,
              out: torch.Tensor | None = None) -> None:
        """§2 lines 5-7 at the mask entries ``idx[j0:j0 + k]`` (``ghat``, ``m_old``: their k
        values): m zeroed on ``old_support`` (indices into m; ``None``: everywhere), then
        m[idx - base] ← β1·m_old + (1-β1)·ĝ·coef (``clip``: coef from the norm, else 1);
        θ ← θ·dec + the AdamS update on ``segs``, the
        segments' other elements decayed in the same walk, or (``out``) θ·dec + the update
        written to ``out`` and θ left as it is."""
        k = ghat.numel()
        tables = self._segment_tables(segs)
        dec = 1.0 - hp.lr * tables.wd
        count("adams", 28 * k + (0 if old_support is None else 12 * old_support.numel())
               + (0 if out is not None else 8 * tables.decayed))
        if out is None:      # the off-mask update (and the first half of the on-mask one)
            self._decay(tables, dec)
        if old_support is None:
            m.zero_()
        elif old_support.numel():
            self._fill(m, old_support, 0.0)
        blocks = tables.blocks
        if not blocks.numel():
            return
        run(_adams_kernel, (blocks.numel() // 2,), blocks, tables.params, idx, j0,
            base, ghat, m, ghat if out is None else out, m_old,
            ghat if clip is None else clip.norm, 0.0 if clip is None else clip.max_norm, dec,
            *adams_scalars(hp), CLIP=clip is not None, HAS_OUT=out is not None,
            BIAS=BIAS_CODES[hp.bias_correction],
            BLOCK=K_BLOCK, **_OPTS)

    def scatter_params(self, idx: torch.Tensor, segs: list[ParamSegment], values: torch.Tensor,
                       lr: float) -> None:
        """θ ← θ·dec on the segments, then θ[idx[a:b]] ← values[src:src + b - a] for each."""
        tables = self._segment_tables(segs)
        count("scatter_params", 16 * tables.entries + 8 * tables.decayed)
        self._decay(tables, 1.0 - lr * tables.wd)   # first: the scatter overwrites the mask
        if tables.blocks.numel():
            run(_scatter_params_kernel, (tables.blocks.numel() // 2,), tables.blocks,
                tables.params, idx, values, BLOCK=K_BLOCK)

    def count_common(self, a: torch.Tensor, b: torch.Tensor | None, bits: torch.Tensor
                     ) -> torch.Tensor:
        """How many of the indices ``a`` are among ``b``: ``b``'s bits set in the scratch bitmap
        ``bits`` (uint8, whole 16-byte words; ``b`` None: its bits are there already), then
        ``a``'s counted; an int64 device tensor."""
        assert bits.numel() % 16 == 0, "the overlap's bitmap is whole 16-byte words"
        na, nb = a.numel(), 0 if b is None else b.numel()
        count("count_common", 9 * (na + nb))    # the bitmap's zeroing is a torch op
        words = bits.view(torch.int32)
        if b is not None:
            words.zero_()

            def mark(first, n, _parts):
                run(_mark_bits_kernel, (triton.cdiv(n, K_BLOCK),), b[first:], n, words,
                    BLOCK=K_BLOCK)
            self._over_k(nb, mark, sums=False)

        def lookup(first, n, parts):
            run(_count_bits_kernel, (triton.cdiv(n, K_BLOCK),), a[first:], n, words, parts,
                BLOCK=K_BLOCK)
        return self._over_k(na, lookup, torch.int64)
