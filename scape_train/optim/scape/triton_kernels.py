"""Triton kernels behind :mod:`scape_train.optim.scape.kernels` (do not call these directly).

Importing this module imports triton; :mod:`kernels` imports it lazily, only when the Triton
backend is chosen, so the package imports on machines without triton and a test's
``TRITON_INTERPRET=1`` is set before triton is first imported.

Layout. Element ``i`` of a mask is bit ``i % 8`` of byte ``i // 8`` (little-endian). The compaction
(gather) and expansion (scatter) run in two passes over blocks of ``BLOCK`` elements:
1. ``_count_kernel``: the popcount of each block;
2. an exclusive prefix sum over the block counts (``torch.cumsum``, exact in int64) gives each
   block's first payload slot; inside a block ``tl.cumsum`` of the bits gives each set element's
   slot. Gather stores ``values[i]`` at its slot, scatter loads it from there.

Values are moved as same-width integers (float32 as int32, bf16 as int16, ...): gather and scatter
only copy bits, which keeps them exact for every dtype (NaN payloads included) and sidesteps the
interpreter's limited bf16 support.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_payload_count

# Elements per program. Large blocks keep the launch count (and, under TRITON_INTERPRET, the
# per-program interpreter overhead) low; 4096 elements = 512 packed bytes.
BLOCK = 4096
PACK_BLOCK_BYTES = 1024
NUM_WARPS = 8

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _load_bits(mask_ptr, offs, n):
    """int32 0/1 for elements ``offs`` of a bool mask's bytes (0 beyond ``n``)."""
    inb = offs < n
    bits = tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.int32)
    return tl.where(inb, (bits != 0).to(tl.int32), 0)


@triton.jit
def _pack_kernel(mask_ptr, out_ptr, n, nbytes, BLOCK_BYTES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    byte_offs = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    shifts = tl.arange(0, 8)
    elem = byte_offs[:, None] * 8 + shifts[None, :]  # [BLOCK_BYTES, 8]
    bits = tl.load(mask_ptr + elem, mask=elem < n, other=0).to(tl.int32)
    bits = (bits != 0).to(tl.int32)
    byte = tl.sum(bits << shifts[None, :], axis=1)  # distinct bits: sum == bitwise or
    tl.store(out_ptr + byte_offs, byte.to(tl.uint8), mask=byte_offs < nbytes)


@triton.jit
def _unpack_kernel(packed_ptr, out_ptr, n, nbytes, BLOCK_BYTES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    byte_offs = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    byte = tl.load(packed_ptr + byte_offs, mask=byte_offs < nbytes, other=0).to(tl.int32)
    shifts = tl.arange(0, 8)
    bits = (byte[:, None] >> shifts[None, :]) & 1
    elem = byte_offs[:, None] * 8 + shifts[None, :]
    tl.store(out_ptr + elem, bits.to(tl.uint8), mask=elem < n)


@triton.jit
def _count_kernel(mask_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = _load_bits(mask_ptr, offs, n)
    tl.store(counts_ptr + pid, tl.sum(bits, axis=0).to(tl.int64))


@triton.jit
def _block_slots(mask_ptr, starts_ptr, n, BLOCK: tl.constexpr):
    """This block's element offsets, each set element's payload slot, and which are set."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = _load_bits(mask_ptr, offs, n)
    slot = tl.load(starts_ptr + pid) + (tl.cumsum(bits, axis=0) - bits).to(tl.int64)
    return offs, slot, bits != 0


@triton.jit
def _gather_kernel(values_ptr, mask_ptr, starts_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs, slot, keep = _block_slots(mask_ptr, starts_ptr, n, BLOCK)
    tl.store(out_ptr + slot, tl.load(values_ptr + offs, mask=keep), mask=keep)


@triton.jit
def _scatter_kernel(payload_ptr, mask_ptr, starts_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs, slot, keep = _block_slots(mask_ptr, starts_ptr, n, BLOCK)
    tl.store(out_ptr + offs, tl.load(payload_ptr + slot, mask=keep), mask=keep)


# ----------------------------------------------------------------------------------------------
# host-side launchers (inputs already validated by kernels.py)


def _as_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A contiguous flat uint8 view of a bool mask (zero-copy when already contiguous)."""
    return mask.reshape(-1).contiguous().view(torch.uint8)


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """A contiguous flat integer view with the same element width (bits unchanged)."""
    flat = t.reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    int_dtype = _INT_OF_SIZE.get(flat.element_size())
    if int_dtype is None or flat.is_complex():
        raise TypeError(f"gather/scatter kernels do not support dtype {t.dtype}")
    return flat.view(int_dtype)


def _block_starts(mask_flat: torch.Tensor, n: int, known: int | None = None
                  ) -> tuple[torch.Tensor, int]:
    """Exclusive prefix sum of per-block popcounts, and the total popcount: ``known`` when the
    caller knows it (no host sync), else read back (one host sync)."""
    nblocks = triton.cdiv(n, BLOCK)
    counts = torch.empty(nblocks, dtype=torch.int64, device=mask_flat.device)
    _count_kernel[(nblocks,)](mask_flat, counts, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    ends = torch.cumsum(counts, dim=0)
    return ends - counts, (int(ends[-1]) if known is None else known)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    n = mask.numel()
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=mask.device)
    if n == 0:
        return out
    grid = (triton.cdiv(nbytes, PACK_BLOCK_BYTES),)
    _pack_kernel[grid](_as_bytes(mask), out, n, nbytes, BLOCK_BYTES=PACK_BLOCK_BYTES,
                       num_warps=NUM_WARPS)
    return out


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    if n == 0:
        return out.view(torch.bool)
    nbytes = packed.numel()
    grid = (triton.cdiv(nbytes, PACK_BLOCK_BYTES),)
    _unpack_kernel[grid](packed.contiguous(), out, n, nbytes, BLOCK_BYTES=PACK_BLOCK_BYTES,
                         num_warps=NUM_WARPS)
    return out.view(torch.bool)


def gather_masked(values: torch.Tensor, mask: torch.Tensor, count: int | None = None
                  ) -> torch.Tensor:
    mask_flat = _as_bytes(mask)
    n = values.numel()
    if n == 0:
        return values.new_empty(0)
    starts, total = _block_starts(mask_flat, n, count)
    src = _as_int(values)
    out = torch.empty(total, dtype=src.dtype, device=values.device)
    if total:
        _gather_kernel[(starts.numel(),)](src, mask_flat, starts, out, n, BLOCK=BLOCK,
                                          num_warps=NUM_WARPS)
    return out.view(values.dtype)


def scatter_masked(payload: torch.Tensor, mask: torch.Tensor, out: torch.Tensor,
                   count: int | None = None) -> torch.Tensor:
    mask_flat = _as_bytes(mask)
    n = out.numel()
    if n == 0:
        check_payload_count(payload.numel(), 0)
        return out
    starts, total = _block_starts(mask_flat, n, count)
    check_payload_count(payload.numel(), total)
    if total == 0:
        return out
    # write in place when `out` is contiguous (views with a storage offset included); otherwise
    # work on a contiguous copy and copy it back, which keeps the "in place" contract
    dst = out if out.is_contiguous() else out.contiguous()
    _scatter_kernel[(starts.numel(),)](_as_int(payload), mask_flat, starts, _as_int(dst), n,
                                       BLOCK=BLOCK, num_warps=NUM_WARPS)
    if dst is not out:
        out.copy_(dst)
    return out
