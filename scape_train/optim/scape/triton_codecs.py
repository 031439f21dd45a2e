"""The masks' Triton kernels (the CUDA path): whole-range bit packing and the segment codings
of :mod:`.mask_coding` (``bitmap`` / ``indices`` / ``elias_fano`` segments and implicit all-ones
ones). Reached through :class:`.triton_passes.TritonPasses`; tests run them under
``TRITON_INTERPRET=1``. Their format, bit for bit, is :mod:`.torch_codecs`' (and
:func:`.kernels.pack_bits`'): every byte, mask bit and index equals the torch path's.

No host reads (NCCL's rule). Every size -- grid, output, table -- comes from the host-known plan
(segments and their counts ``k``), never from the device: no ``.item()``, no output whose size
depends on the data, so the step never waits for the device and the mask's all-gather keeps
overlapping. The one dependency across the data -- which one (``j``) of its segment a set bit
is -- is a two-pass block scan: a popcount per block, an exclusive ``torch.cumsum`` over the
blocks, then ``tl.cumsum`` inside the block. A plan whose counts do not match the bits cannot
be caught without a read-back: writes are masked to stay inside their
segment, so such bytes come out wrong, never memory outside them.

Tasks. A kernel runs one program per *task*, a row of a host-built int64 table (cached per plan,
``_COLUMNS``): a block of positions of one segment's stream. One launch covers every segment of
every owner whatever their sizes, and no block spans two segments.

- encode (owner): the shard is zeroed as int32 words. Bitmap segments are packed with plain byte
  stores (each program owns its bytes). Indices / Elias-Fano: count, scan, then every one ORs its
  ``width``-bit field (and, Elias-Fano, its upper bit ``h + j``) into the words with
  ``atomic_or``: neighbouring fields share words, and OR gives the same bits in any order, so
  the atomics are relaxed (Triton's default, acq_rel at GPU scope, orders memory for nothing).
- decode (every rank): a zeroed mask, then each segment writes its ones and their sorted flat
  indices: ``all`` and ``indices`` segments per one (the field ``j`` is the ``j``-th one),
  bitmaps and Elias-Fano upper vectors through the scan (``p = ((pos - j) << L) | low_j``).
  Segments lie in flat order (owner by owner), so the ``j``-th one of a segment goes to slot
  ``at + j``, ``at`` from the plan: the indices come out sorted for every coding.

Bytes per launch are reported to ``profiling.DeviceOpCounter`` (:mod:`.counted_launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...host_to_device import host_table, upload
from .counted_launch import launch
from .kernels import check_mask, check_packed
from .mask_format import ALL, BITMAP, ELIAS_FANO, INDICES, SegCode, bits_bytes
from .mask_format import KIND_CODES as _KIND

BLOCK = 4096            # stream positions per program (4096 bits = 512 packed bytes)
PACK_BYTES = 1024       # bytes packed or unpacked per program (8192 elements)
NUM_WARPS = 8

K_INDICES, K_EF = tl.constexpr(_KIND[INDICES]), tl.constexpr(_KIND[ELIAS_FANO])

# The task table's columns (int64; the kernels read them with _col):
#   SRC       where the task's stream starts in the kernel's input: an element of the owner's
#             bits (encode) or a bit of the gathered bytes (decode)
#   NBITS     the stream's length (positions at or past it are not read)
#   B0        the task's first position in the stream
#   FIRST     the row of the stream's first task: the scan restarts at each segment
#   KIND      the segment's coding (_KIND)
#   FLAT      the segment's first flat index (decode)
#   NUMEL, K, WIDTH   the segment's length, ones and field bits
#   LOW_BIT   the bit where the segment's field stream (or, encoding, its bitmap) starts in the
#             shard / the gathered bytes
#   HIGH_BIT, HIGH_NBITS   encode: the Elias-Fano upper vector's first bit in the shard, length
#   AT        decode: the slot of the segment's first one in the sorted indices
_COLUMNS = ("SRC", "NBITS", "B0", "FIRST", "KIND", "FLAT", "NUMEL", "K", "WIDTH", "LOW_BIT",
            "HIGH_BIT", "HIGH_NBITS", "AT")
(SRC, NBITS, B0, FIRST, KIND, FLAT, NUMEL, K, WIDTH, LOW_BIT, HIGH_BIT, HIGH_NBITS,
 AT) = (tl.constexpr(i) for i in range(len(_COLUMNS)))
NCOL = tl.constexpr(len(_COLUMNS))


# ----------------------------------------------------------------------------------------------
# shared device helpers


@triton.jit
def _col(tab_ptr, col: tl.constexpr):
    """Column ``col`` of this program's task row."""
    return tl.load(tab_ptr + tl.program_id(0).to(tl.int64) * NCOL + col)


@triton.jit
def _stream_bits(src_ptr, tab_ptr, PACKED: tl.constexpr, BLOCK: tl.constexpr):
    """This task's stream positions and their bits (int32 0/1, 0 past the stream's end); the
    input is one byte per element or, ``PACKED``, little-endian bits."""
    pos = _col(tab_ptr, B0) + tl.arange(0, BLOCK)
    inside = pos < _col(tab_ptr, NBITS)
    at = _col(tab_ptr, SRC) + pos
    if PACKED:
        byte = tl.load(src_ptr + (at >> 3), mask=inside, other=0).to(tl.int32)
        bits = (byte >> (at & 7).to(tl.int32)) & 1
    else:
        bits = (tl.load(src_ptr + at, mask=inside, other=0) != 0).to(tl.int32)
    return pos, tl.where(inside, bits, 0)


@triton.jit
def _count_kernel(src_ptr, tab_ptr, counts_ptr, PACKED: tl.constexpr, BLOCK: tl.constexpr):
    """The task's popcount into ``counts[pid + 1]`` (program 0 also zeroes ``counts[0]``: an
    inclusive scan of them is the exclusive scan of the popcounts)."""
    _, bits = _stream_bits(src_ptr, tab_ptr, PACKED, BLOCK)
    pid = tl.program_id(0)
    tl.store(counts_ptr + pid + 1, tl.sum(bits, axis=0).to(tl.int64))
    tl.store(counts_ptr, tl.zeros([], tl.int64), mask=pid == 0)


@triton.jit
def _rank_in_segment(starts_ptr, tab_ptr, bits):
    """``j`` of each set bit: how many ones of its segment come before it."""
    pid = tl.program_id(0)
    base = tl.load(starts_ptr + pid) - tl.load(starts_ptr + _col(tab_ptr, FIRST))
    return base + (tl.cumsum(bits, axis=0) - bits).to(tl.int64)


@triton.jit
def _field_mask(width):
    return (tl.full([], 1, tl.int64) << width) - 1


@triton.jit
def _read_fields(buf_ptr, buf_len, start, width, valid):
    """The ``width``-bit fields (<= 33) at bits ``start`` of ``buf``: 5 bytes cover any of them."""
    byte = start >> 3
    word = tl.zeros_like(start)
    for i in tl.static_range(5):
        b = tl.load(buf_ptr + byte + i, mask=valid & (byte + i < buf_len), other=0)
        word |= b.to(tl.int64) << (8 * i)
    return (word >> (start & 7)) & _field_mask(width)


@triton.jit
def _or_bits(words_ptr, bit, value, valid):
    """OR ``value`` (< 2^33) into the little-endian bit stream of int32 ``words`` at ``bit``: it
    spans at most two words (a 31-bit offset plus 33 bits); int64 shifts wrap, the truncating
    casts keep each word's 32 bits."""
    word = bit >> 5
    shifted = value << (bit & 31)
    lo = shifted.to(tl.int32)
    hi = (shifted >> 32).to(tl.int32)
    tl.atomic_or(words_ptr + word, lo, mask=valid & (lo != 0), sem="relaxed")
    tl.atomic_or(words_ptr + word + 1, hi, mask=valid & (hi != 0), sem="relaxed")


# ----------------------------------------------------------------------------------------------
# whole-range packing (kernels.pack_bits' layout)


@triton.jit
def _pack_kernel(mask_ptr, out_ptr, n, nbytes, PACK_BYTES: tl.constexpr):
    byte_offs = tl.program_id(0).to(tl.int64) * PACK_BYTES + tl.arange(0, PACK_BYTES)
    shifts = tl.arange(0, 8)
    elem = byte_offs[:, None] * 8 + shifts[None, :]
    bits = (tl.load(mask_ptr + elem, mask=elem < n, other=0) != 0).to(tl.int32)
    byte = tl.sum(bits << shifts[None, :], axis=1)  # distinct bits: sum == bitwise or
    tl.store(out_ptr + byte_offs, byte.to(tl.uint8), mask=byte_offs < nbytes)


@triton.jit
def _unpack_kernel(packed_ptr, out_ptr, n, nbytes, PACK_BYTES: tl.constexpr):
    byte_offs = tl.program_id(0).to(tl.int64) * PACK_BYTES + tl.arange(0, PACK_BYTES)
    byte = tl.load(packed_ptr + byte_offs, mask=byte_offs < nbytes, other=0).to(tl.int32)
    shifts = tl.arange(0, 8)
    elem = byte_offs[:, None] * 8 + shifts[None, :]
    tl.store(out_ptr + elem, ((byte[:, None] >> shifts[None, :]) & 1).to(tl.uint8),
             mask=elem < n)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """:func:`.kernels.pack_bits` in one launch."""
    check_mask(mask)
    n = mask.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=mask.device)
    if n:
        launch(_pack_kernel, (triton.cdiv(out.numel(), PACK_BYTES),), "pack_bits",
               n + out.numel(), mask.reshape(-1).contiguous().view(torch.uint8), out, n,
               out.numel(), PACK_BYTES=PACK_BYTES, num_warps=NUM_WARPS)
    return out


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`.kernels.unpack_bits` in one launch."""
    check_packed(packed, n)
    out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    if n:
        launch(_unpack_kernel, (triton.cdiv(packed.numel(), PACK_BYTES),), "unpack_bits",
               packed.numel() + n, packed.contiguous(), out, n, packed.numel(),
               PACK_BYTES=PACK_BYTES, num_warps=NUM_WARPS)
    return out.view(torch.bool)


# ----------------------------------------------------------------------------------------------
# mask encode (one owner's segments -> its shard)


@triton.jit
def _encode_bitmap_kernel(bits_ptr, tab_ptr, shard_ptr, PACK_BYTES: tl.constexpr):
    byte = (_col(tab_ptr, B0) >> 3) + tl.arange(0, PACK_BYTES)
    shifts = tl.arange(0, 8)
    elem = byte[:, None] * 8 + shifts[None, :]
    numel = _col(tab_ptr, NBITS)
    bits = tl.load(bits_ptr + _col(tab_ptr, SRC) + elem, mask=elem < numel, other=0)
    packed = tl.sum((bits != 0).to(tl.int32) << shifts[None, :], axis=1)   # distinct bits: OR
    tl.store(shard_ptr + (_col(tab_ptr, LOW_BIT) >> 3) + byte, packed.to(tl.uint8),
             mask=byte * 8 < numel)


@triton.jit
def _encode_fields_kernel(bits_ptr, tab_ptr, starts_ptr, words_ptr, BLOCK: tl.constexpr):
    pos, bits = _stream_bits(bits_ptr, tab_ptr, False, BLOCK)
    j = _rank_in_segment(starts_ptr, tab_ptr, bits)
    valid = (bits != 0) & (j < _col(tab_ptr, K))
    width = _col(tab_ptr, WIDTH)
    is_ef = _col(tab_ptr, KIND) == K_EF
    low = tl.where(is_ef, pos & _field_mask(width), pos)
    _or_bits(words_ptr, _col(tab_ptr, LOW_BIT) + j * width, low, valid & (width > 0))
    if is_ef:
        up = (pos >> width) + j                         # the high part's bit: h_j + j
        _or_bits(words_ptr, _col(tab_ptr, HIGH_BIT) + up, tl.full(up.shape, 1, tl.int64),
                 valid & (up < _col(tab_ptr, HIGH_NBITS)))


class _Tasks:
    """A task table, built segment by segment on the host (per segment, not per row: a large
    model's table has ~10^5 rows)."""

    def __init__(self):
        self.rows: list[torch.Tensor] = []
        self.n = 0

    def add(self, stream: int, nbits: int, step: int, **cols) -> None:
        """The tasks of one segment's stream of ``nbits`` positions, ``step`` per task."""
        base = dict.fromkeys(_COLUMNS, 0) | cols | {"SRC": stream, "NBITS": nbits,
                                                   "FIRST": self.n}
        rows = host_table([base[c] for c in _COLUMNS]).repeat(
            -(-nbits // step), 1)
        rows[:, _COLUMNS.index("B0")] = torch.arange(0, nbits, step)
        self.rows.append(rows)
        self.n += rows.shape[0]

    def table(self, device: torch.device) -> torch.Tensor:
        t = torch.cat(self.rows) if self.rows else torch.zeros(0, len(_COLUMNS),
                                                               dtype=torch.int64)
        return upload(t, device)


def _nbytes(tab: torch.Tensor) -> int:
    return tab.numel() * tab.element_size()


# Bytes each launch reads and writes, from the plan: its task rows (8 B a column), what its
# tasks read (1 B per element of the owner's bits, packed bytes of the gathered buffer), the
# scan's starts (8 B per task, twice: its own and its stream's first), what it writes (the
# stream's bytes; 1 B of mask and 8 B of index per one decoded).

def _encode_tables(segs: list[SegCode], lo: int, device: torch.device) -> dict:
    """The owner's bitmap and field task tables, and each launch's bytes."""
    bitmap, fields = _Tasks(), _Tasks()
    for s in segs:
        src, at_bit = s.flat_start - lo, 8 * s.off
        if s.kind == BITMAP:
            bitmap.add(src, s.numel, 8 * PACK_BYTES, LOW_BIT=at_bit)
        elif s.kind in (INDICES, ELIAS_FANO) and s.k:
            fields.add(src, s.numel, BLOCK, KIND=_KIND[s.kind], NUMEL=s.numel, K=s.k,
                       WIDTH=s.width, LOW_BIT=at_bit, HIGH_BIT=8 * (s.off + s.low_bytes),
                       HIGH_NBITS=8 * s.high_bytes)
    t = {"bitmap": bitmap.table(device), "fields": fields.table(device)}
    pack = [s for s in segs if s.kind == BITMAP]
    coded = [s for s in segs if s.kind in (INDICES, ELIAS_FANO) and s.k]
    nfields = t["fields"].shape[0]
    t["bytes"] = {
        "mask_encode_bitmap": _nbytes(t["bitmap"]) + sum(s.numel + s.high_bytes for s in pack),
        "mask_encode_count": _nbytes(t["fields"]) + sum(s.numel for s in coded) + 8 * nfields,
        "mask_encode_fields": _nbytes(t["fields"]) + sum(s.numel + s.nbytes for s in coded)
        + 16 * nfields}
    return t


def _block_starts(src: torch.Tensor, tab: torch.Tensor, packed: bool, name: str, nbytes: int
                  ) -> torch.Tensor:
    """Each task's first scan slot: the exclusive prefix sum of the tasks' popcounts (one
    ``cumsum`` over them behind a zero)."""
    counts = torch.empty(tab.shape[0] + 1, dtype=torch.int64, device=src.device)
    launch(_count_kernel, (tab.shape[0],), name, nbytes, src, tab, counts, PACKED=packed,
           BLOCK=BLOCK, num_warps=NUM_WARPS)
    return torch.cumsum(counts, dim=0)


def encode_mask(plan, own_bits: torch.Tensor, rank: int) -> torch.Tensor:
    """The owner's shard (``plan.shard_bytes`` uint8) of its bits over its range."""
    shard_bytes, lo = plan.shard_bytes, plan.part.ranges[rank][0]
    key = ("triton_encode", rank, str(own_bits.device))
    if key not in plan.cache:
        plan.cache[key] = _encode_tables(plan.segs[rank], lo, own_bits.device)
    t = plan.cache[key]
    words = torch.zeros(-(-shard_bytes // 4), dtype=torch.int32, device=own_bits.device)
    shard = words.view(torch.uint8)[:shard_bytes]
    bits = own_bits.contiguous().view(torch.uint8)
    bitmap, fields, nbytes = t["bitmap"], t["fields"], t["bytes"]
    if bitmap.shape[0]:
        launch(_encode_bitmap_kernel, (bitmap.shape[0],), "mask_encode_bitmap",
               nbytes["mask_encode_bitmap"], bits, bitmap, shard, PACK_BYTES=PACK_BYTES,
               num_warps=NUM_WARPS)
    if fields.shape[0]:
        starts = _block_starts(bits, fields, False, "mask_encode_count",
                               nbytes["mask_encode_count"])
        launch(_encode_fields_kernel, (fields.shape[0],), "mask_encode_fields",
               nbytes["mask_encode_fields"], bits, fields, starts, words, BLOCK=BLOCK,
               num_warps=NUM_WARPS)
    return shard


# ----------------------------------------------------------------------------------------------
# mask decode (every owner's shard -> the mask and the sorted indices of its ones)


@triton.jit
def _emit(words_ptr, idx_ptr, tab_ptr, j, p, valid):
    """Write flat ``FLAT + p`` to slot ``AT + j`` of the indices and set its bit in the packed
    mask (int32 words, little-endian: ``pack_bits``'s bytes; atomic, as segments and blocks
    share words)."""
    valid = valid & (p >= 0) & (p < _col(tab_ptr, NUMEL)) & (j < _col(tab_ptr, K))
    flat = _col(tab_ptr, FLAT) + p
    bit = tl.full(p.shape, 1, tl.int32) << (flat & 31).to(tl.int32)
    tl.atomic_or(words_ptr + (flat >> 5), bit, mask=valid, sem="relaxed")
    tl.store(idx_ptr + _col(tab_ptr, AT) + j, flat, mask=valid)


@triton.jit
def _decode_scan_kernel(buf_ptr, buf_len, tab_ptr, starts_ptr, words_ptr, idx_ptr,
                        BLOCK: tl.constexpr):
    """Bitmaps and Elias-Fano upper vectors: the ``j``-th set bit, at ``pos``, is the one at
    ``pos`` (bitmap) or at ``((pos - j) << L) | low_j`` (Elias-Fano)."""
    pos, bits = _stream_bits(buf_ptr, tab_ptr, True, BLOCK)
    j = _rank_in_segment(starts_ptr, tab_ptr, bits)
    p = pos
    if _col(tab_ptr, KIND) == K_EF:
        width = _col(tab_ptr, WIDTH)
        low = _read_fields(buf_ptr, buf_len, _col(tab_ptr, LOW_BIT) + j * width, width, bits != 0)
        p = ((pos - j) << width) | low
    _emit(words_ptr, idx_ptr, tab_ptr, j, p, bits != 0)


@triton.jit
def _decode_direct_kernel(buf_ptr, buf_len, tab_ptr, words_ptr, idx_ptr, BLOCK: tl.constexpr):
    """All-ones segments (the ``j``-th one is at ``j``) and index fields (it is field ``j``)."""
    j = _col(tab_ptr, B0) + tl.arange(0, BLOCK)
    valid = j < _col(tab_ptr, NBITS)
    p = j
    if _col(tab_ptr, KIND) == K_INDICES:
        width = _col(tab_ptr, WIDTH)
        p = _read_fields(buf_ptr, buf_len, _col(tab_ptr, LOW_BIT) + j * width, width, valid)
    _emit(words_ptr, idx_ptr, tab_ptr, j, p, valid)


def _decode_tables(segs: list[list[SegCode]], shard_bytes: int, device: torch.device) -> dict:
    """The plan's scan and direct task tables, the number of ones, and each launch's bytes."""
    scan, direct, at = _Tasks(), _Tasks(), 0
    for r, codes in enumerate(segs):
        for s in codes:
            base = r * shard_bytes + s.off              # in the gathered buffer
            ones = s.numel if s.kind == ALL else s.k
            seg = dict(KIND=_KIND[s.kind], FLAT=s.flat_start, NUMEL=s.numel, K=ones,
                       WIDTH=s.width, LOW_BIT=8 * base, AT=at)
            if s.kind == BITMAP:
                scan.add(8 * base, s.numel, BLOCK, **seg)
            elif s.kind == ELIAS_FANO:
                scan.add(8 * (base + s.low_bytes), 8 * s.high_bytes, BLOCK, **seg)
            else:                                       # all ones, or index fields
                direct.add(0, ones, BLOCK, **seg)
            at += ones
    t = {"scan": scan.table(device), "direct": direct.table(device), "ones": at}
    flat = [s for codes in segs for s in codes]
    scanned = [s for s in flat if s.kind in (BITMAP, ELIAS_FANO)]
    listed = [s for s in flat if s.kind in (ALL, INDICES)]
    nscan = t["scan"].shape[0]
    # per one decoded: its 8-byte index and its mask bit's int32 word (an atomic OR)
    t["bytes"] = {
        "mask_decode_count": _nbytes(t["scan"]) + sum(s.high_bytes for s in scanned)
        + 8 * nscan,
        "mask_decode_scan": _nbytes(t["scan"]) + 16 * nscan
        + sum(s.high_bytes + s.low_bytes + 12 * s.k for s in scanned),
        "mask_decode_direct": _nbytes(t["direct"])
        + sum(s.low_bytes + 12 * (s.numel if s.kind == ALL else s.k) for s in listed)}
    return t


def decode_mask(plan, gathered: torch.Tensor | None, device: torch.device
                ) -> tuple[None, torch.Tensor, torch.Tensor]:
    """``(None, indices, bits)``: the flat indices of the ones from every owner's shard,
    increasing, and the mask packed 1 bit per element (``mask_format.bits_bytes(total)``
    uint8), for every segment coding."""
    key = ("triton_decode", str(device))
    if key not in plan.cache:
        plan.cache[key] = _decode_tables(plan.segs, plan.shard_bytes, device)
    t = plan.cache[key]
    buf = gathered.contiguous() if gathered is not None and gathered.numel() else \
        torch.zeros(1, dtype=torch.uint8, device=device)       # a valid pointer, never read
    idx = torch.empty(t["ones"], dtype=torch.int64, device=device)
    words = torch.zeros(bits_bytes(plan.total) // 4, dtype=torch.int32, device=device)
    scan, direct, nbytes = t["scan"], t["direct"], t["bytes"]
    if scan.shape[0]:
        starts = _block_starts(buf, scan, True, "mask_decode_count", nbytes["mask_decode_count"])
        launch(_decode_scan_kernel, (scan.shape[0],), "mask_decode_scan",
               nbytes["mask_decode_scan"], buf, buf.numel(), scan, starts, words, idx,
               BLOCK=BLOCK, num_warps=NUM_WARPS)
    if direct.shape[0]:
        launch(_decode_direct_kernel, (direct.shape[0],), "mask_decode_direct",
               nbytes["mask_decode_direct"], buf, buf.numel(), direct, words, idx, BLOCK=BLOCK,
               num_warps=NUM_WARPS)
    return None, idx, words.view(torch.uint8)
