"""Dense AdamS as one Triton kernel over every parameter of a bucket (CUDA).

Each element is read once (θ, g, m) and written once (θ, m): 20 bytes per fp32 parameter, against
about 112 for :func:`.adams.adams_update_`'s ten separate ops, and one launch per bucket (two: the
whole blocks, then each tensor's tail) against ten per tensor.

**An address table, not flattened state.** θ is the model's own tensors, and g is autograd's
tensors or views of DDP's buckets: the optimizer owns neither layout. Flattening them would mean
copying into a flat buffer and back every step (8 more bytes per parameter each way) or taking
over the parameters' storage. So, as torch's multi-tensor apply and SCAPE's fused step
(``scape/triton_passes.py``) do, each program reads one row of a device table of addresses
``(θ, g, m, numel)`` and one entry of a block table ``(row, first element)``, so that no program
straddles two tensors. The tables are built on the host from the tensors' addresses and sizes,
uploaded without a host sync, and cached by their content: a steady step (DDP's bucket views, or
the caching allocator giving autograd the same blocks) uploads nothing.

**Whole blocks without a mask.** A program over a whole block stores unmasked, and where every
address of the bucket is 16-byte aligned the kernel says so (``ALIGNED``), so each thread moves
16 bytes per access; the tensors' tails (numel not a multiple of the block) take a second, masked
launch. ``scripts/triton_compile_check.py`` reads the 16-byte loads in the PTX.

**Rounding as torch's**: the arithmetic is :func:`.adams.adams_update_`'s, op for op, computed in
fp32 (bf16 / fp16 tensors are widened on load and rounded once on store), with no FMA
contraction (``enable_fp_fusion=False``) and correctly rounded ``div_rn`` / ``sqrt_rn``.
Tested against the reference under ``TRITON_INTERPRET=1`` (tests/test_adams_fast.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host_to_device import host_table, upload
from .adams_constants import AdamSConstants
from .scape.counted_launch import count, run

BLOCK = 4096           # elements per program
_OPTS = dict(enable_fp_fusion=False)
BIAS_CODES = {"adam": 1, "official": 2, "none": 0}     # adams_values' BIAS
_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _at(table_entry, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """A tensor's address from the table, as a pointer to DTYPE (16-byte aligned if ALIGNED)."""
    ptr = table_entry.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


def adams_scalars(c: AdamSConstants) -> tuple[float, ...]:
    """:func:`adams_values`' scalar arguments from ``beta1`` to ``ns``, for step ``c``."""
    return (c.beta1, c.beta2, 1.0 - c.beta1, 1.0 - c.beta2, c.bc1, c.sqrt_bc2, c.eps,
            -c.step_size)


@triton.jit
def adams_values(g, mo, beta1, beta2, omb1, omb2, bc1, sqrt_bc2, eps, ns, BIAS: tl.constexpr):
    """AdamS on fp32 values, :func:`.adams.adams_update_`'s arithmetic op for op: the new
    momentum from the old ``mo`` and the gradient ``g``, and the step to add to θ (after its
    decay). ``ns`` = -step size; ``omb1``, ``omb2`` = 1-β1, 1-β2; BIAS 1 adam, 2 official, 0 none."""
    # v = β2·prev² + (1-β2)·g², prev the momentum before this step's update
    if BIAS == 2:
        prev = tl.div_rn(mo, bc1)
    else:
        prev = mo
    v = prev * prev
    v = v * beta2
    gg = omb2 * g
    gg = gg * g
    v = v + gg
    mn = mo * beta1
    mn = mn + omb1 * g
    den = tl.sqrt_rn(v)
    if BIAS == 1:
        den = tl.div_rn(den, sqrt_bc2)
    den = den + eps
    return mn, tl.div_rn(ns * mn, den)


@triton.jit
def _adams_dense_kernel(blocks, table, coef, beta1, beta2, omb1, omb2, bc1, sqrt_bc2, eps, ns,
                        dec, DTYPE: tl.constexpr, CLIP: tl.constexpr, DECAY: tl.constexpr,
                        BIAS: tl.constexpr, TAIL: tl.constexpr, ALIGNED: tl.constexpr,
                        BLOCK: tl.constexpr):
    """AdamS on one block of one tensor: θ, m updated in place from g (times ``coef`` if CLIP).
    TAIL: the block may run past the tensor's end (masked); else it is whole."""
    pid = tl.program_id(0)
    row = table + 4 * tl.load(blocks + 2 * pid)
    offs = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK).to(tl.int64)
    if not TAIL:
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    th_ptr = _at(tl.load(row), DTYPE, ALIGNED) + offs
    g_ptr = _at(tl.load(row + 1), DTYPE, ALIGNED) + offs
    m_ptr = _at(tl.load(row + 2), DTYPE, ALIGNED) + offs
    if TAIL:
        keep = offs < tl.load(row + 3)
        g = tl.load(g_ptr, mask=keep, other=0.0).to(tl.float32)
        mo = tl.load(m_ptr, mask=keep, other=0.0).to(tl.float32)
        th = tl.load(th_ptr, mask=keep, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr).to(tl.float32)
        mo = tl.load(m_ptr).to(tl.float32)
        th = tl.load(th_ptr).to(tl.float32)
    if CLIP:
        g = g * tl.load(coef)
    mn, upd = adams_values(g, mo, beta1, beta2, omb1, omb2, bc1, sqrt_bc2, eps, ns, BIAS)
    if DECAY:
        th = th * dec
    th = th + upd
    if TAIL:
        tl.store(th_ptr, th.to(DTYPE), mask=keep)
        tl.store(m_ptr, mn.to(DTYPE), mask=keep)
    else:
        tl.store(th_ptr, th.to(DTYPE))
        tl.store(m_ptr, mn.to(DTYPE))


class TritonAdamS:
    """:data:`.adams.AdamSUpdate` by :func:`_adams_dense_kernel` for tensors on ``device``."""

    def __init__(self, device: torch.device, block: int = BLOCK):
        self.device = torch.device(device)
        self.block = block
        self._tables: dict[tuple, torch.Tensor] = {}

    def _cached(self, key: tuple, build):
        hit = self._tables.get(key)
        if hit is None:
            if len(self._tables) > 64:      # addresses change with autograd's allocations
                self._tables.clear()
            hit = self._tables[key] = build()
        return hit

    def _block_tables(self, numels: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, first element) of the whole blocks, and of the tails, of tensors of ``numels``."""
        def build():
            n = host_table(list(numels))
            whole = n.div(self.block, rounding_mode="floor")
            row = torch.repeat_interleave(torch.arange(len(numels)), whole)
            first = (torch.arange(row.numel()) - (torch.cumsum(whole, 0) - whole)[row]) * self.block
            tails = [(i, k - k % self.block) for i, k in enumerate(numels) if k % self.block]
            flat = torch.cat([torch.stack([row, first], 1).reshape(-1),
                              host_table([v for t in tails for v in t])])
            return upload(flat, self.device), 2 * row.numel()
        table, split = self._cached(("blocks", numels), build)
        return table[:split], table[split:]

    def __call__(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                 exp_avgs: list[torch.Tensor], c: AdamSConstants,
                 coef: torch.Tensor | None) -> None:
        dtype = params[0].dtype
        if dtype not in _DTYPES:
            raise TypeError(f"AdamS (triton): parameters of dtype {dtype} are not supported; "
                            f"use {sorted(str(d) for d in _DTYPES)} or impl foreach")
        rows, aligned = [], True
        for p, g, m in zip(params, grads, exp_avgs):
            if not (p.is_contiguous() and g.is_contiguous() and m.is_contiguous()) \
                    or not (p.dtype == g.dtype == m.dtype == dtype):
                raise ValueError("AdamS (triton) needs contiguous parameters, gradients and "
                                 "momenta of one dtype; use impl foreach for other layouts")
            ptrs = (p.data_ptr(), g.data_ptr(), m.data_ptr())
            aligned = aligned and all(a % 16 == 0 for a in ptrs)
            rows.append((*ptrs, p.numel()))
        table = self._cached(("rows", tuple(rows)),
                             lambda: upload([v for r in rows for v in r], self.device))
        whole, tails = self._block_tables(tuple(r[3] for r in rows))
        numel = sum(r[3] for r in rows)
        count("adams_dense", 5 * dtype.itemsize * numel)
        args = (table, coef if coef is not None else table, *adams_scalars(c), c.decay)
        meta = dict(DTYPE=_DTYPES[dtype], CLIP=coef is not None, DECAY=c.weight_decay != 0.0,
                    BIAS=BIAS_CODES[c.bias_correction], ALIGNED=aligned, BLOCK=self.block, **_OPTS)
        if whole.numel():
            run(_adams_dense_kernel, (whole.numel() // 2,), whole, *args, TAIL=False, **meta)
        if tails.numel():
            count("adams_dense_tail", 0)      # one more launch; its bytes are counted above
            run(_adams_dense_kernel, (tails.numel() // 2,), tails, *args, TAIL=True, **meta)
