"""How the next mask travels: a coding per owner segment, of a size every rank knows in advance.

The codings (``optimizer.mask_coding``) and their sizes are :mod:`.mask_format`'s; the codecs
are the passes' (:mod:`.torch_codecs`, :mod:`.triton_codecs`), handed in as ``lib``.

Sizes depend only on ``(numel, k)`` per segment, and ``k`` per segment follows from the density
schedule (:func:`.masks.mask_counts`): every rank builds the same :class:`MaskPlan` on the host
without any exchange, the shard of the all-gather is the largest owner's coded size, and nothing
is read back from the device. A coding whose size depends on the data (the change from the
previous mask, varints) would need its sizes exchanged and read on the host before an
equal-size all-gather could be allocated -- a host sync per step and the loss of the gather's
overlap -- see docs/wire_format.md ("The change from the previous mask") for why it is not used.
"""

from __future__ import annotations

import torch

from .kernels import packed_numel
from .mask_format import MASK_CODINGS, SegCode, choose, seg_code
from .partition import ParamLayout, PartitionMap


class MaskPlan:
    """Every owner's segment codings for a mask of one density, and the shard they fill."""

    def __init__(self, part: PartitionMap, layout: ParamLayout | None, counts: list[list[int]],
                 coding: str, total: int):
        if coding not in MASK_CODINGS:
            raise ValueError(f"mask_coding must be one of {MASK_CODINGS}, got {coding!r}")
        self.part, self.coding, self.total = part, coding, total
        self.legacy = coding == "bitmap"
        self.lengths = [hi - lo for lo, hi in part.ranges]
        self.segs: list[list[SegCode]] = []
        self.cache: dict = {}        # the codecs' tables, per device (built on first use)
        if self.legacy:
            # the spec §4 format: the whole range packed, shards padded to the largest (at least 1)
            self.rank_bytes = [packed_numel(n) for n in self.lengths]
            self.shard_bytes = max(1, max(self.rank_bytes))
            return
        if layout is None:
            raise ValueError(f"mask_coding={coding!r} needs the parameter layout")
        for segs, ks in zip(part.segments, counts):
            off, codes = 0, []
            for seg, k in zip(segs, ks):
                kind = choose(coding, seg.numel, k, layout.excluded[seg.tensor])
                codes.append(seg_code(kind, seg.flat_start, seg.numel, k, off))
                off += codes[-1].nbytes
            self.segs.append(codes)
        self.rank_bytes = [sum(s.nbytes for s in codes) for codes in self.segs]
        self.shard_bytes = max(self.rank_bytes)    # 0: every segment all ones, nothing to send

    def drop_decode_tables(self) -> None:
        """Free the codecs' tables (a plan no longer in use)."""
        self.cache = {}

    def kinds(self) -> dict[str, int]:
        """How many segments use each coding (for reports)."""
        out: dict[str, int] = {}
        for codes in self.segs:
            for s in codes:
                out[s.kind] = out.get(s.kind, 0) + 1
        return out

    def encode(self, own_bits: torch.Tensor, rank: int, lib) -> torch.Tensor:
        """The owner's shard (``shard_bytes`` uint8) of its bits over its range, coded by the
        passes ``lib``."""
        if not self.legacy:
            return lib.encode_mask(self, own_bits, rank)
        shard = torch.zeros(self.shard_bytes, dtype=torch.uint8, device=own_bits.device)
        shard[:packed_numel(own_bits.numel())] = lib.pack_bits(own_bits)
        return shard

    def decode(self, gathered: torch.Tensor | None, device: torch.device, lib
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(mask, indices, bits)``: what the passes ``lib`` make of every owner's shard -- the
        bool mask, and/or the sorted flat indices of its ones with the mask packed 1 bit per
        element (``pack_bits``'s layout, padded to ``mask_format.bits_bytes``); ``None`` for
        what the decode does not make (the Triton decode: no bool mask, except for the
        ``bitmap`` coding, which gives the bool mask alone)."""
        if not self.legacy:
            return lib.decode_mask(self, gathered, device)
        assert gathered is not None
        pieces = [lib.unpack_bits(gathered[r * self.shard_bytes:
                                           r * self.shard_bytes + packed_numel(n)], n)
                  for r, n in enumerate(self.lengths) if n]
        mask = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.bool, device=device)
        if mask.numel() != self.total:
            raise RuntimeError(f"assembled mask has {mask.numel()} bits, expected {self.total}")
        return mask, None, None
