"""The fused SCAPE step's passes as Triton kernels (CUDA), called through :func:`.passes.lib`.

Arguments: raw data pointers (``int``, ``None`` for NULL), per-tensor and per-segment tables as
host int64 tables (``traffic.table``), fp32 scalars; :data:`.traffic.TRAFFIC` counts each call.

- **Nothing is read back to the host.** Sums (Σ c², Σ ĝ², ...) come back as 0-d float64 tensors
  on the device (per-program partial sums added by one ``sum``), and ``scape_adams`` takes the
  clipping coefficient as a device tensor (``coef``). Grid sizes come from host-known counts
  (the density schedule's k).
- **Tables travel to the device** once per content: the per-tensor gradient table (pointers
  change when autograd allocates new gradients), the parameter tables (stable for a mask plan).
  Each is cached by its bytes, with the launch's block table beside it.
- **Rounding as torch's**: ``enable_fp_fusion=False`` (no FMA contraction), ``div_rn``/
  ``sqrt_rn`` (correctly rounded, where Triton's ``/`` and ``sqrt`` are approximate on the GPU),
  sums of squares in float64 (in another order than torch's, so they agree to rounding).

Work per pass: the prepare is the one full-size pass (read g, e (and m on a general step),
write e), every other pass touches the k mask positions only. Full-size passes run over all
tensors in one launch through a block table ``(tensor, start, numel)``; k-sized passes over
segments through ``(segment, first index-list entry)`` blocks, so a block never straddles two
parameters.

Tested against the fused engine's torch ops under ``TRITON_INTERPRET=1``
(tests/test_triton_passes.py), which runs these kernels on CPU tensors.
"""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl

from ...host_to_device import host_table, upload
from . import traffic
from .counted_launch import run
from .traffic import ONE_BITS

FULL_BLOCK = 4096      # elements per program of a full-size pass
K_BLOCK = 1024         # index-list entries per program of a k-sized pass
_OPTS = dict(enable_fp_fusion=False)


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _f32(addr):
    return addr.to(tl.pointer_type(tl.float32))


@triton.jit
def _i64(addr):
    return addr.to(tl.pointer_type(tl.int64))


@triton.jit
def _lane(base, offs, ALIGNED: tl.constexpr):
    """``base + offs``, a block of contiguous addresses, stated 16-byte aligned where the
    launcher checked it (a raw address hides it from the compiler): 16-byte accesses instead of
    4- or 8-byte ones. (The sum is formed here: ``multiple_of`` marks the op defining a value,
    and a helper's argument has none.)"""
    ptr = base + offs
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _sq_sum(x, keep):
    d = x.to(tl.float64)
    return tl.sum(tl.where(keep, d * d, 0.0), axis=0)


@triton.jit
def _prepare_block(g, e_ptr, m_addr, f, keep, parts, pid, beta1, s, lo, hi, rho_addr, cand_addr,
                   GENERAL: tl.constexpr, CAND: tl.constexpr, ALIGNED: tl.constexpr):
    """c = e + s·g (GENERAL: (β1·m + s·g) + e) at the flat indices ``f``; e ← c; Σ c² into
    ``parts[pid]``. CAND (sharded): on the own range [lo, hi) also cand[f - lo] = ρ[f - lo] + c.
    ALIGNED: m's block is 16-byte aligned (as ``e_ptr``'s, stated by the caller)."""
    e = tl.load(e_ptr, mask=keep, other=0.0)
    if GENERAL:             # m_addr is 0 otherwise: no pointer is made of it
        m_ptr = _f32(m_addr) + f
        if ALIGNED:
            m_ptr = tl.multiple_of(m_ptr, 16)
        m = tl.load(m_ptr, mask=keep, other=0.0)
        c = m * beta1 + s * g
        c = c + e
    else:
        c = e + s * g
    tl.store(e_ptr, c, mask=keep)
    if CAND:
        fo = f - lo
        own = keep & (fo >= 0) & (fo < hi - lo)
        r = tl.load(_f32(rho_addr) + fo, mask=own, other=0.0)
        tl.store(_f32(cand_addr) + fo, r + c, mask=own)
    tl.store(parts + pid, _sq_sum(c, keep))


@triton.jit
def _prepare_kernel(blocks, grad_table, e_addr, m_addr, parts, beta1, s, lo, hi, rho_addr,
                    cand_addr,
                    GENERAL: tl.constexpr, CAND: tl.constexpr, BLOCK: tl.constexpr):
    """The prepare on one block of one tensor, the tensors' gradients read through
    ``grad_table``."""
    pid = tl.program_id(0)
    t = tl.load(blocks + 3 * pid)
    offs = tl.load(blocks + 3 * pid + 1) + tl.arange(0, BLOCK).to(tl.int64)
    keep = offs < tl.load(blocks + 3 * pid + 2)
    g = tl.load(_f32(tl.load(grad_table + 2 * t)) + offs, mask=keep, other=0.0)
    f = tl.load(grad_table + 2 * t + 1) + offs
    _prepare_block(g, _f32(e_addr) + f, m_addr, f, keep, parts, pid, beta1, s, lo, hi, rho_addr,
                   cand_addr, GENERAL, CAND, False)


@triton.jit
def _prepare_flat_kernel(n, g_addr, e_addr, m_addr, parts, beta1, s, lo, hi, rho_addr,
                         cand_addr, GENERAL: tl.constexpr, CAND: tl.constexpr,
                         BLOCK: tl.constexpr):
    """The prepare over one flat gradient (``optimizer.flat_grads``): one contiguous range, and
    g, e and m 16-byte aligned (the launcher checks; a raw address hides it from the compiler,
    so it is stated with ``multiple_of``), hence 16-byte loads and stores where the table
    kernel's come 4 bytes at a time (the PTX shows it: scripts/triton_compile_check.py)."""
    pid = tl.program_id(0)
    f = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = f < n
    g = tl.load(tl.multiple_of(_f32(g_addr) + f, 16), mask=keep, other=0.0)
    _prepare_block(g, tl.multiple_of(_f32(e_addr) + f, 16), m_addr, f, keep, parts, pid, beta1,
                   s, lo, hi, rho_addr, cand_addr, GENERAL, CAND, True)


@triton.jit
def _prepare_fix_kernel(blocks, support_table, pidx_addr, e_addr, m_addr, parts, beta1, s,
                        BLOCK: tl.constexpr):
    """At m's support (e_{t-1} = 0 there): e[i] ← β1·m[i] + s·g[i]; Σ (c² - old e²)."""
    pid = tl.program_id(0)
    row = support_table + 4 * tl.load(blocks + 2 * pid)
    j = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK).to(tl.int64)
    keep = j < tl.load(row + 3)
    i = tl.load(_i64(pidx_addr) + j, mask=keep, other=0)
    g = tl.load(_f32(tl.load(row)) + (i - tl.load(row + 1)), mask=keep, other=0.0)
    m = tl.load(_f32(m_addr) + i, mask=keep, other=0.0)
    old = tl.load(_f32(e_addr) + i, mask=keep, other=0.0)
    c = m * beta1 + s * g
    tl.store(_f32(e_addr) + i, c, mask=keep)
    tl.store(parts + pid, _sq_sum(c, keep) - _sq_sum(old, keep))


@triton.jit
def _rho_kernel(pidx_addr, k, rho_addr, m_addr, beta1, ALIGNED: tl.constexpr,
                BLOCK: tl.constexpr):
    """ρ[i] ← β1·m[i] at the owner's m support."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(_lane(_i64(pidx_addr), j, ALIGNED), mask=keep, other=0)
    m = tl.load(_f32(m_addr) + i, mask=keep, other=0.0)
    tl.store(_f32(rho_addr) + i, m * beta1, mask=keep)


@triton.jit
def _gather_kernel(k, idx_addr, base, src_addr, out_addr, parts, TAKE: tl.constexpr,
                   ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """out[j] = src[idx[j] - base] (TAKE: then src[...] = 0); Σ out²."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(_lane(_i64(idx_addr), j, ALIGNED), mask=keep, other=0) - base
    v = tl.load(_f32(src_addr) + i, mask=keep, other=0.0)
    tl.store(_lane(_f32(out_addr), j, ALIGNED), v, mask=keep)
    if TAKE:
        tl.store(_f32(src_addr) + i, tl.zeros_like(v), mask=keep)
    tl.store(parts + pid, _sq_sum(v, keep))


@triton.jit
def _ghat_kernel(k, idx_addr, base, b_addr, rho_addr, m_addr, m_old_addr, parts, nb, d,
                 HAS_RHO: tl.constexpr, HAS_M: tl.constexpr, HAS_M_OLD: tl.constexpr,
                 ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """ĝ = (m·(-β1) + b (+ ρ, then ρ ← 0)) / (1-β1) in place of b; m read at the mask and
    (HAS_M_OLD) stored to m_old[j], the old momentum at the mask, for the AdamS pass; or (not HAS_M)
    read from m_old, where it was gathered; Σ ĝ²."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    t = tl.load(_lane(_f32(b_addr), j, ALIGNED), mask=keep, other=0.0)
    if HAS_RHO or HAS_M:
        i = tl.load(_lane(_i64(idx_addr), j, ALIGNED), mask=keep, other=0) - base
    if HAS_RHO:
        t = t + tl.load(_f32(rho_addr) + i, mask=keep, other=0.0)
        tl.store(_f32(rho_addr) + i, tl.zeros_like(t), mask=keep)
    if HAS_M:
        m = tl.load(_f32(m_addr) + i, mask=keep, other=0.0)
        if HAS_M_OLD:
            tl.store(_lane(_f32(m_old_addr), j, ALIGNED), m, mask=keep)
    else:
        m = tl.load(_lane(_f32(m_old_addr), j, ALIGNED), mask=keep, other=0.0)
    g = tl.div_rn(m * nb + t, d)
    tl.store(_lane(_f32(b_addr), j, ALIGNED), g, mask=keep)
    tl.store(parts + pid, _sq_sum(g, keep))


@triton.jit
def _fill_kernel(dst_addr, idx_addr, k, value, parts, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """dst[idx] ← value; Σ of the old values' squares."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(_lane(_i64(idx_addr), j, ALIGNED), mask=keep, other=0)
    old = tl.load(_f32(dst_addr) + i, mask=keep, other=0.0)
    tl.store(_f32(dst_addr) + i, tl.zeros_like(old) + value, mask=keep)
    tl.store(parts + pid, _sq_sum(old, keep))


@triton.jit
def _zero_kernel(dst_addr, n, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(_lane(_f32(dst_addr), offs, ALIGNED), tl.zeros((BLOCK,), tl.float32),
             mask=offs < n)


@triton.jit
def _row_decay(row, col):
    """A parameter-table row's decay factor (a float32's bits in an int64 column)."""
    return tl.load(row + col).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _decay_kernel(blocks, decay_table, BLOCK: tl.constexpr):
    """θ ← θ·dec on one block of a segment (``decay_table`` rows: θ's pointer, dec's bits)."""
    pid = tl.program_id(0)
    row = decay_table + 2 * tl.load(blocks + 3 * pid)
    offs = tl.load(blocks + 3 * pid + 1) + tl.arange(0, BLOCK).to(tl.int64)
    keep = offs < tl.load(blocks + 3 * pid + 2)
    ptr = _f32(tl.load(row)) + offs
    th = tl.load(ptr, mask=keep, other=0.0)
    tl.store(ptr, th * _row_decay(row, 1), mask=keep)


@triton.jit
def _adams_kernel(blocks, param_table, idx_addr, j0, base, ghat_addr, m_addr, out_addr, m_old_addr,
                  coef_ptr, beta1, beta2, omb1, omb2, bc1, sqrt_bc2, eps, ns,
                  CLIP: tl.constexpr, HAS_OUT: tl.constexpr, BIAS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """AdamS at one segment block of the mask (``scape_adams``'s arithmetic, op for op): θ
    updated (the decay pass has run), or θ·dec + the update written to out; m[i] ← m'.
    ``m_old``: m at the mask, from the ĝ pass (before m was zeroed)."""
    pid = tl.program_id(0)
    row = param_table + 7 * tl.load(blocks + 2 * pid)
    j = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK).to(tl.int64)
    keep = j < tl.load(row + 3)
    i = tl.load(_i64(idx_addr) + j, mask=keep, other=0)
    g = tl.load(_f32(ghat_addr) + (j - j0), mask=keep, other=0.0)
    if CLIP:
        g = g * tl.load(coef_ptr)
    m_old = tl.load(_f32(m_old_addr) + (j - j0), mask=keep, other=0.0)
    if BIAS == 2:
        prev = tl.div_rn(m_old, bc1)
    else:
        prev = m_old
    v = prev * prev
    v = v * beta2
    gg = omb2 * g
    gg = gg * g
    v = v + gg
    mn = m_old * beta1
    mn = mn + omb1 * g
    den = tl.sqrt_rn(v)
    if BIAS == 1:
        den = tl.div_rn(den, sqrt_bc2)
    den = den + eps
    upd = tl.div_rn(ns * mn, den)
    th_ptr = _f32(tl.load(row)) + (i - tl.load(row + 1))
    th = tl.load(th_ptr, mask=keep, other=0.0)
    if HAS_OUT:
        th = th * _row_decay(row, 6)
        tl.store(_f32(out_addr) + (j - j0), th + upd, mask=keep)
    else:
        tl.store(th_ptr, th + upd, mask=keep)
    tl.store(_f32(m_addr) + (i - base), mn, mask=keep)


@triton.jit
def _scatter_params_kernel(blocks, scatter_table, idx_addr, values_addr, BLOCK: tl.constexpr):
    """θ[idx[j] - off] ← values[src + j - a] on one segment block."""
    pid = tl.program_id(0)
    row = scatter_table + 8 * tl.load(blocks + 2 * pid)
    j = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK).to(tl.int64)
    keep = j < tl.load(row + 3)
    i = tl.load(_i64(idx_addr) + j, mask=keep, other=0)
    v = tl.load(_f32(values_addr) + (tl.load(row + 4) - tl.load(row + 2) + j), mask=keep)
    tl.store(_f32(tl.load(row)) + (i - tl.load(row + 1)), v, mask=keep)


@triton.jit
def _mark_bits_kernel(idx_addr, k, words_addr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Set bit ``i`` of the packed bitmap (int32 words, little-endian: ``pack_bits``'s bytes) for
    every entry ``i`` of the index list (atomic: entries of one word lie in several programs'
    blocks)."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(_lane(_i64(idx_addr), j, ALIGNED), mask=keep, other=0)
    bit = tl.full((BLOCK,), 1, tl.int32) << (i & 31).to(tl.int32)
    tl.atomic_or(words_addr.to(tl.pointer_type(tl.int32)) + (i >> 5), bit, mask=keep)


@triton.jit
def _count_bits_kernel(idx_addr, k, words_addr, parts, ALIGNED: tl.constexpr,
                       BLOCK: tl.constexpr):
    """How many entries ``i`` of the index list have bit ``i`` set in the packed bitmap."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    i = tl.load(_lane(_i64(idx_addr), j, ALIGNED), mask=keep, other=0)
    w = tl.load(words_addr.to(tl.pointer_type(tl.int32)) + (i >> 5), mask=keep, other=0)
    tl.store(parts + pid, tl.sum(((w >> (i & 31).to(tl.int32)) & 1).to(tl.int64), axis=0))


# ----------------------------------------------------------------------------------------------
# host side


def _aligned(*addresses: int) -> bool:
    """Every address 16-byte aligned: the kernels' ``ALIGNED`` (their contiguous blocks start
    at multiples of the block size, so the block's first address is aligned too)."""
    return all(a % 16 == 0 for a in addresses)


def _host_rows(addr: int, rows: int, width: int) -> tuple[int, ...]:
    """A host int64 table's contents (``traffic.table``), row-major."""
    return tuple((ctypes.c_int64 * (rows * width)).from_address(addr)) if rows else ()


class TritonPasses:
    """The fused step's passes for tensors on ``device`` (see the module docstring); sums come
    back as device tensors and ``scape_adams`` takes the clipping coefficient as one."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._tables: dict[tuple, tuple] = {}

    # -- tables ----------------------------------------------------------------------------
    def _cached(self, key: tuple, build) -> tuple:
        hit = self._tables.get(key)
        if hit is None:
            if len(self._tables) > 64:    # gradient tables change with autograd's allocations
                self._tables.clear()
            hit = self._tables[key] = build()
        return hit

    def _dev(self, values) -> torch.Tensor:
        return upload(values, self.device)

    def _table(self, addr: int, rows: int, width: int) -> tuple[tuple, torch.Tensor]:
        """A host table's contents and its device copy (cached by content)."""
        vals = _host_rows(addr, rows, width)
        return vals, self._cached(("table", width, vals), lambda: self._dev(list(vals)))

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
            return self._dev(torch.stack(cols, 1).reshape(-1))
        return self._cached(("blocks", block, with_end, tuple(starts), tuple(ends)), build)

    def _tensor_blocks(self, grad_table: int, ntensor: int, numels: int) -> tuple:
        """(block table (tensor, start, numel), device gradient table) for a full-size pass."""
        sizes = list(_host_rows(numels, ntensor, 1))
        _, grad_dev = self._table(grad_table, ntensor, 2)
        return self._blocks([0] * ntensor, sizes, FULL_BLOCK, True), grad_dev

    def _segment_blocks(self, tab: int, nseg: int, width: int) -> tuple:
        """(block table (segment, first entry), device segment table) for a k-sized pass over
        segment rows ``(pointer, offset, a, b, ...)``."""
        rows, dev = self._table(tab, nseg, width)
        return self._blocks(list(rows[2::width]), list(rows[3::width]), K_BLOCK, False), dev

    def _parts(self, n: int, dtype=torch.float64) -> torch.Tensor:
        return torch.zeros(max(n, 1), dtype=dtype, device=self.device)

    # -- the passes --------------------------------------
    def _prepare(self, ntensor, grad_table, numels, e, m, s, lo=0, hi=0, rho=None, cand=None,
                 beta1=0.0, general=False) -> torch.Tensor:
        """One launch of the full-size prepare: the flat kernel when the gradient is one flat
        buffer (one table row at flat offset 0) and it, e and m are 16-byte aligned, else the
        table kernel; returns Σ c²."""
        kw = dict(GENERAL=general, CAND=cand is not None, BLOCK=FULL_BLOCK, **_OPTS)
        rest = (s, lo, hi, rho or 0, cand or 0)
        row = _host_rows(grad_table, 1, 2) if ntensor == 1 else None
        if row is not None and row[1] == 0 and _aligned(row[0], e, m or 0):
            n = _host_rows(numels, 1, 1)[0]
            nblk = triton.cdiv(n, FULL_BLOCK)
            parts = self._parts(nblk)
            if nblk:
                run(_prepare_flat_kernel, (nblk,), n, row[0], e, m or 0, parts, beta1, *rest,
                    **kw)
            return parts.sum()
        blocks, grad_dev = self._tensor_blocks(grad_table, ntensor, numels)
        nblk = blocks.numel() // 3
        parts = self._parts(nblk)
        if nblk:
            run(_prepare_kernel, (nblk,), blocks, grad_dev, e, m or 0, parts, beta1, *rest, **kw)
        return parts.sum()

    def scape_prepare_replicated_general(self, ntensor, grad_table, numels, e, m, beta1, s):
        return self._prepare(ntensor, grad_table, numels, e, m, s, beta1=beta1, general=True)

    def _add_scaled_grads(self, ntensor, grad_table, numels, e, s, lo=0, hi=0, rho=None, cand=None
                          ) -> torch.Tensor:
        return self._prepare(ntensor, grad_table, numels, e, None, s, lo, hi, rho, cand)

    def scape_prepare_replicated(self, ntensor, grad_table, numels, e, m, pidx, kp, support_table,
                                 npseg,
                                 beta1, s):
        sq = self._add_scaled_grads(ntensor, grad_table, numels, e, s)
        blocks, support_dev = self._segment_blocks(support_table, npseg, 4)
        nblk = blocks.numel() // 2
        if nblk:
            parts = self._parts(nblk)
            run(_prepare_fix_kernel, (nblk,), blocks, support_dev, pidx, e, m, parts, beta1, s,
                BLOCK=K_BLOCK, **_OPTS)
            sq = sq + parts.sum()
        return sq

    def scape_prepare_sharded(self, ntensor, grad_table, numels, e, rho, m, pidx_own, kp, lo, hi,
                              cand, beta1, s):
        if kp:       # first: the candidate reads ρ
            def launch(a, n, _parts):
                i = pidx_own + 8 * a
                run(_rho_kernel, (triton.cdiv(n, K_BLOCK),), i, n, rho, m, beta1,
                    ALIGNED=_aligned(i), BLOCK=K_BLOCK, **_OPTS)
            self._over_k(kp, launch, sums=False)
        return self._add_scaled_grads(ntensor, grad_table, numels, e, s, lo, hi, rho, cand)

    def scape_prepare_gather(self, total, g, e, m, pidx, kp, idx, k, payload, m_old, beta1, s):
        """The prepare with m's support known, the payload and m gathered at M_t, m zeroed on
        its old support, as launches in a row; returns Σ c² off
        M_t."""
        grad_table, numels = traffic.table([[g, 0]], 2), host_table([total])
        support_table = traffic.table([[g, 0, 0, kp]], 4)
        sq = self.scape_prepare_replicated(1, traffic.ptr(grad_table), traffic.ptr(numels), e, m,
                                           pidx,
                                           kp, traffic.ptr(support_table), 1 if kp else 0, beta1, s)
        sq = sq - self.scape_gather(k, idx, 0, e, payload)
        self._gather(k, idx, 0, m, m_old, False)
        if kp:
            self._fill(m, pidx, kp, 0.0)
        return sq

    def scape_prepare_take(self, total, g, x, rho, m, pidx, kp, lo, hi, cand, idx, k, rows,
                           nrows, send, own_a, own_b, m_old, rho_at, beta1, s):
        """The sharded prepare, the owner's m and ρ gathered at its entries (ρ then zeroed), m
        zeroed on its old support, the payload's rows taken, as launches in a row; returns
        Σ ε² of the new ε."""
        grad_table, numels = traffic.table([[g, 0]], 2), host_table([total])
        sq = self.scape_prepare_sharded(1, traffic.ptr(grad_table), traffic.ptr(numels), x, rho, m,
                                        pidx, kp, lo, hi, cand, beta1, s)
        n_own = own_b - own_a
        if n_own:
            self._gather(n_own, idx + 8 * own_a, lo, m, m_old, False)
            self._gather(n_own, idx + 8 * own_a, lo, rho, rho_at, True)   # and ρ ← 0 there
        if kp:
            self._fill(m, pidx, kp, 0.0)
        starts_offs = _host_rows(rows, nrows, 2)
        ends = list(starts_offs[2::2]) + [k]
        for r in range(nrows):
            a, off = starts_offs[2 * r], starts_offs[2 * r + 1]
            if ends[r] > a:
                sq = sq - self._gather(ends[r] - a, idx + 8 * a, 0, x, send + 4 * (a + off),
                                       True)
        return sq

    def scape_gather(self, k, idx, base, src, values):
        return self._gather(k, idx, base, src, values, False)

    def scape_take(self, k, idx, src, values):
        return self._gather(k, idx, 0, src, values, True)

    def _over_k(self, k: int, launch, dtype=torch.float64, sums: bool = True):
        """A pass over ``k`` index-list entries as ``launch(first, n, parts)`` calls: the whole
        blocks in one (n a multiple of the block, which Triton specializes as divisible by 16,
        so the mask is uniform over each thread's run and aligned streams load 16 bytes at a
        time), the tail block in another. Per-block partial sums in block order, as one
        launch would leave them; returns their sum (``sums=False``: a pass without any)."""
        parts = self._parts(triton.cdiv(k, K_BLOCK), dtype) if sums else None
        main = k - k % K_BLOCK
        if main:
            launch(0, main, parts)
        if k > main:
            launch(main, k - main, None if parts is None else parts[main // K_BLOCK:])
        return None if parts is None else parts.sum()

    def _gather(self, k, idx, base, src, values, take: bool) -> torch.Tensor:
        def launch(a, n, parts):
            i, v = idx + 8 * a, values + 4 * a
            run(_gather_kernel, (triton.cdiv(n, K_BLOCK),), n, i, base, src, v, parts,
                TAKE=take, ALIGNED=_aligned(i, v), BLOCK=K_BLOCK)
        return self._over_k(k, launch)

    def scape_ghat(self, k, idx, base, b, rho, m, m_old, beta1, d):
        def launch(a, n, parts):
            i, bb, mm = (idx or 0) + 8 * a, b + 4 * a, (m_old or 0) + 4 * a   # idx: None with
            # neither ρ nor m (the old m read from m_old)
            run(_ghat_kernel, (triton.cdiv(n, K_BLOCK),), n, i, base, bb, rho or 0, m or 0,
                mm if m_old else 0, parts, -beta1, d, HAS_RHO=rho is not None,
                HAS_M=m is not None, HAS_M_OLD=m_old is not None,
                ALIGNED=_aligned(i if idx else 0, bb, mm if m_old else 0), BLOCK=K_BLOCK,
                **_OPTS)
        return self._over_k(k, launch)

    def _decay(self, tab, nseg, width, col) -> None:
        """θ·dec over the segment rows' ``[s0, s1)`` (columns ``col``, ``col + 1``; dec's bits
        in the next), where dec is not 1: one full-size launch (a coalesced pass costs less than
        a gap loop per lane)."""
        rows = _host_rows(tab, nseg, width)
        sel = [rows[q:q + width] for q in range(0, len(rows), width)
               if rows[q + col + 2] != ONE_BITS and rows[q + col + 1] > rows[q + col]]
        if not sel:
            return
        decay_dev = self._cached(("decay", tuple((r[0], r[col + 2]) for r in sel)),
                                 lambda: self._dev([v for r in sel for v in (r[0], r[col + 2])]))
        blocks = self._blocks([r[col] for r in sel], [r[col + 1] for r in sel], FULL_BLOCK,
                              True)
        run(_decay_kernel, (blocks.numel() // 3,), blocks, decay_dev, BLOCK=FULL_BLOCK, **_OPTS)

    def scape_adams(self, idx, j0, k, base, ghat, m, mlen, zidx, n_zero, param_table, nseg, out,
                    m_old,
                    coef, clip, beta1, beta2, omb1, omb2, bc1, sqrt_bc2, eps, ns, bias):
        if out is None:      # the off-mask update (and the first half of the on-mask one)
            self._decay(param_table, nseg, 7, 4)
        if n_zero < 0:
            run(_zero_kernel, (triton.cdiv(mlen, FULL_BLOCK),), m, mlen, ALIGNED=_aligned(m),
                BLOCK=FULL_BLOCK)
        elif n_zero:
            self._fill(m, zidx, n_zero, 0.0)
        blocks, param_dev = self._segment_blocks(param_table, nseg, 7)
        nblk = blocks.numel() // 2
        if not nblk:
            return
        if not isinstance(coef, torch.Tensor):     # filled on the device: no host copy
            coef = torch.full((1,), coef, dtype=torch.float32, device=self.device)
        run(_adams_kernel, (nblk,), blocks, param_dev, idx, j0, base, ghat, m, out or 0, m_old,
            coef.reshape(1).to(torch.float32), beta1, beta2, omb1, omb2,
            bc1, sqrt_bc2, eps, ns, CLIP=bool(clip), HAS_OUT=out is not None,
            BIAS=int(bias), BLOCK=K_BLOCK, **_OPTS)

    def _fill(self, dst, idx, k, value):
        def launch(a, n, parts):
            i = idx + 8 * a
            run(_fill_kernel, (triton.cdiv(n, K_BLOCK),), dst, i, n, value, parts,
                ALIGNED=_aligned(i), BLOCK=K_BLOCK)
        return self._over_k(k, launch)

    def scape_scatter_params(self, idx, scatter_table, nseg, values):
        self._decay(scatter_table, nseg, 8, 5)   # first: the scatter overwrites the mask positions
        blocks, scatter_dev = self._segment_blocks(scatter_table, nseg, 8)
        nblk = blocks.numel() // 2
        if nblk:
            run(_scatter_params_kernel, (nblk,), blocks, scatter_dev, idx, values, BLOCK=K_BLOCK)

    def scape_count_common(self, a, na, b, nb, bits, nbytes):
        """The overlap count: the bitmap zeroed (``nbytes``: whole 16-byte words) and ``b``'s
        bits set (unless ``b`` is NULL: the bits given), ``a``'s counted."""
        assert nbytes % 16 == 0, "the overlap's bitmap is whole 16-byte words"
        nwords = nbytes // 4
        if b is not None and nwords:      # b NULL: its bits are marked already
            run(_zero_kernel, (triton.cdiv(nwords, FULL_BLOCK),), bits, nwords,
                ALIGNED=_aligned(bits), BLOCK=FULL_BLOCK)

        def mark(first, n, parts):
            at = b + 8 * first
            run(_mark_bits_kernel, (triton.cdiv(n, K_BLOCK),), at, n, bits,
                ALIGNED=_aligned(at), BLOCK=K_BLOCK)

        def count(first, n, parts):
            at = a + 8 * first
            run(_count_bits_kernel, (triton.cdiv(n, K_BLOCK),), at, n, bits, parts,
                ALIGNED=_aligned(at), BLOCK=K_BLOCK)
        if b is not None:
            self._over_k(nb, mark, sums=False)
        return self._over_k(na, count, torch.int64)
