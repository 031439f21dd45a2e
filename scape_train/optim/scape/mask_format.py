"""The next mask's wire format: the coding of each owner segment and its size in bytes.

``optimizer.mask_coding``:

``bitmap``      the spec §4 format: the owner's whole range packed 1 bit per element,
                every shard padded to the largest range: ``ceil(numel/8)`` bytes, excluded
                tensors included.
``indices``     per segment, the ``k`` sorted segment-local indices of the ones, each in
                ``w = bit_length(numel - 1)`` bits, bit-packed: ``ceil(k·w/8)`` bytes.
``elias_fano``  per segment, the same sorted indices in Elias-Fano form: each index ``i`` is split
                into ``L`` low bits (written as fixed-width fields, ``k·L`` bits) and a high part
                ``h = i >> L``, written as one set bit at position ``h_j + j`` of an upper bit
                vector of ``U = k + ((numel - 1) >> L) + 1`` bits. Its size is fixed by
                ``(numel, k, L)``; ``L`` is chosen to minimise it (``≈ log2(numel/k)``), for
                about ``2 + log2(numel/k)`` bits per one: 8.6 bits at 1% density, 5.3 at 10%,
                against 100 and 10 bits per one for the bitmap.
``auto``        per segment, the smallest of the three (default; all are lossless, so the masks,
                and everything computed from them, are bit-identical across codings).

In every coding but ``bitmap``, a segment whose mask is known to be all ones (an excluded tensor:
biases, norm gains; or ``k = numel``) is not sent at all. Streams are byte-aligned per segment;
bits are little-endian inside a byte and inside a field (as :func:`pack_bits`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernels import packed_numel

MASK_CODINGS = ("auto", "bitmap", "indices", "elias_fano")
ALL, BITMAP, INDICES, ELIAS_FANO = "all", "bitmap", "indices", "elias_fano"
# the codings as the kernels number them
KIND_CODES = {ALL: 0, BITMAP: 1, INDICES: 2, ELIAS_FANO: 3}
_MAX_FIELD_BITS = 33        # a field read spans at most 5 bytes (33 bits + a 7-bit offset)


def bits_bytes(total: int) -> int:
    """Bytes of a decoded mask's packed bits (the Triton decode's): ``ceil(total / 8)`` padded to
    whole 16-byte words (the kernels' int32 view, aligned loads)."""
    return 16 * -(-total // 128)


def index_width(numel: int) -> int:
    """Bits of one segment-local index into ``numel`` elements."""
    return max(1, (numel - 1).bit_length())


def ef_sizes(numel: int, k: int, low_bits: int) -> tuple[int, int]:
    """(low-stream bytes, upper-stream bytes) of Elias-Fano with ``low_bits`` low bits."""
    upper = k + ((numel - 1) >> low_bits) + 1
    return packed_numel(k * low_bits), packed_numel(upper)


def ef_low_bits(numel: int, k: int) -> int:
    """The number of low bits that makes the Elias-Fano coding of ``k`` of ``numel`` smallest."""
    return min(range(index_width(numel) + 1), key=lambda b: (sum(ef_sizes(numel, k, b)), b))


def coded_bytes(kind: str, numel: int, k: int) -> int:
    """Bytes of one segment's mask in coding ``kind`` (``all`` = not sent)."""
    if kind == ALL:
        return 0
    if kind == BITMAP:
        return packed_numel(numel)
    if kind == INDICES:
        return packed_numel(k * index_width(numel))
    if kind == ELIAS_FANO:
        return sum(ef_sizes(numel, k, ef_low_bits(numel, k)))
    raise ValueError(f"unknown segment coding {kind!r}")


@dataclass(frozen=True)
class SegCode:
    """One owner segment's coding and where its bytes sit in the owner's shard."""

    kind: str
    flat_start: int
    numel: int
    k: int
    width: int        # bits per field: the index (indices) or its low part (elias_fano)
    off: int          # byte offset of the first stream in the owner's shard
    low_bytes: int    # the field stream (indices, elias_fano)
    high_bytes: int   # the bitmap (bitmap) or the upper bit vector (elias_fano)

    @property
    def nbytes(self) -> int:
        return self.low_bytes + self.high_bytes


def choose(coding: str, numel: int, k: int, excluded: bool) -> str:
    """The segment coding for ``mask_coding=coding`` (not ``bitmap``: that is whole-range)."""
    if excluded or k >= numel:
        return ALL
    if coding == "auto":
        # ties: the cheapest to decode first
        return min((BITMAP, ELIAS_FANO, INDICES), key=lambda c: coded_bytes(c, numel, k))
    return coding


def seg_code(kind: str, flat_start: int, numel: int, k: int, off: int) -> SegCode:
    if kind == ALL:
        return SegCode(kind, flat_start, numel, k, 0, off, 0, 0)
    if kind == BITMAP:
        return SegCode(kind, flat_start, numel, k, 0, off, 0, packed_numel(numel))
    if kind == INDICES:
        w = index_width(numel)
        if w > _MAX_FIELD_BITS:
            raise ValueError(f"mask coding 'indices': a segment of {numel} elements needs {w}-bit "
                             f"indices, more than {_MAX_FIELD_BITS}")
        return SegCode(kind, flat_start, numel, k, w, off, packed_numel(k * w), 0)
    low = ef_low_bits(numel, k)
    lo_b, hi_b = ef_sizes(numel, k, low)
    return SegCode(kind, flat_start, numel, k, low, off, lo_b, hi_b)
