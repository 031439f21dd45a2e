"""How the next mask travels: a coding per owner segment, of a size every rank knows in advance.

The codings (``optimizer.mask_coding``) and their sizes are :mod:`.mask_format`'s.

Sizes depend only on ``(numel, k)`` per segment, and ``k`` per segment follows from the density
schedule (:func:`mask_counts`): every rank builds the same :class:`MaskPlan` on the host without
any exchange, the shard of the all-gather is the largest owner's coded size, and nothing is read
back from the device. A coding whose size depends on the data (the change from the previous mask,
varints) would need its sizes exchanged and read on the host before an equal-size all-gather
could be allocated -- a host sync per step and the loss of the gather's overlap -- see
docs/benchmarks.md §3 for why it is not used.

Decoding is vectorised over all segments of all owners (a fixed number of device ops per step,
whatever the number of segments); encoding runs per owned segment, beside the top-k.
"""

from __future__ import annotations

import torch

from ...host_to_device import upload
from .kernels import nonzero_sorted, pack_bits, packed_numel, resolve_backend, unpack_bits
from .mask_format import (ALL, BITMAP, ELIAS_FANO, INDICES, MASK_CODINGS, SegCode, choose,
                          seg_code)
from .partition import ParamLayout, PartitionMap


def _triton_codecs():
    # lazily: the package imports without triton, and a test's TRITON_INTERPRET=1 is in place
    # before triton is first imported
    from . import triton_codecs

    return triton_codecs


def _pack_fields(values: torch.Tensor, width: int, backend: str) -> torch.Tensor:
    """Non-negative int64 ``values`` as ``width``-bit little-endian fields, bit-packed."""
    shifts = torch.arange(width, device=values.device)
    bits = ((values.unsqueeze(1) >> shifts) & 1).bool().reshape(-1)
    return pack_bits(bits, backend=backend)


def _read_fields(buf: torch.Tensor, start: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Fields of ``width`` bits (≤ 33) starting at bit ``start`` of uint8 ``buf`` (padded by 8
    bytes so that a 5-byte read never runs past its end)."""
    byte = start >> 3
    word = torch.zeros_like(start)
    for i in range(5):
        word |= buf.index_select(0, byte + i).long() << (8 * i)
    ones = torch.bitwise_left_shift(torch.ones_like(width), width) - 1
    return (word >> (start & 7)) & ones


class _Group:
    """Device tables of the segments of one coding, in (owner, segment) order."""

    def __init__(self, segs: list[tuple[int, SegCode]], shard_bytes: int, device: torch.device):
        self.n = len(segs)
        self.ones = sum(s.k for _, s in segs)
        self.high_total = sum(s.high_bytes for _, s in segs)
        rows, kcum, hcum = [], 0, 0
        for rank, s in segs:
            base = rank * shard_bytes + s.off          # in the gathered buffer
            rows.append([s.flat_start, s.k, kcum, s.width, 8 * base, base + s.low_bytes, hcum,
                         s.high_bytes])
            kcum += s.k
            hcum += s.high_bytes
        t = upload(rows, device).reshape(-1, 8)
        (self.flat_start, self.k, self.kcum, self.width, self.low_bit, self.high_byte,
         self.hcum, self.high_bytes) = t.unbind(1)

    def seg_of(self, counts: torch.Tensor, total: int) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.n, device=counts.device), counts,
                                       output_size=total)


def _ef_tables(plan: "MaskPlan", grp: "_Group", device: torch.device) -> dict:
    """Per-one constants of a plan's Elias-Fano group: where each one's low field starts (byte,
    bit shift), its width, mask, segment start and high-part offset, and the byte index of the
    concatenated upper vectors. Cached for the newest plan only (the warm-up visits each
    density once): ~7 int64 per one, plus the sorted-index template (one int64 per
    one of the whole mask) -- state the memory plan counts (plan/optimizer_memory.py)."""
    key = str(device)
    if key in plan._ef:
        return plan._ef[key]
    seg = grp.seg_of(grp.k, grp.ones)
    within = torch.arange(grp.ones, device=device) - grp.kcum[seg]
    width = grp.width[seg]
    start = grp.low_bit[seg] + within * width
    bseg = grp.seg_of(grp.high_bytes, grp.high_total)
    max_w = max((s.width for codes in plan.segs for s in codes if s.kind == ELIAS_FANO),
                default=0)                                  # from the host plan: no read back
    # int64 throughout: a narrower shift or width would be converted at every decode
    t = {"byte": start >> 3, "shift": start & 7, "width": width,
         "low_mask": torch.bitwise_left_shift(torch.ones_like(width), width) - 1,
         "nread": max(1, -(-(max_w + 7) // 8)),
         "high_base": 8 * grp.hcum[seg] + within, "flat_start": grp.flat_start[seg],
         "bidx": grp.high_byte[bseg] + torch.arange(grp.high_total, device=device)
         - grp.hcum[bseg]}
    # Sorted flat indices of the whole mask: when every other segment is all ones, each
    # segment's ones form one block of the sorted list, in flat order; the all-ones blocks are
    # constant (``sorted``), the Elias-Fano ones land at ``dest``.
    t["sorted"] = t["dest"] = None
    flat = [s for codes in plan.segs for s in codes]
    if all(s.kind in (ALL, ELIAS_FANO) for s in flat):
        blocks, fixed, at = [], [], 0
        for s in flat:
            if s.kind == ELIAS_FANO:
                blocks.append(at)
                at += s.k
            else:
                fixed.append((at, s.flat_start, s.numel))
                at += s.numel
        srt = torch.empty(at, dtype=torch.int64, device=device)
        for a, f, n in fixed:
            srt[a:a + n] = torch.arange(f, f + n, device=device)
        # EF segments in the group are in the same (owner, segment) order as ``flat``
        t["dest"] = upload(blocks, device)[seg] + within
        t["sorted"] = srt
    plan._ef[key] = t
    return t


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
        self._ef: dict = {}
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
        self._tables: dict = {}
        self._ef: dict = {}          # per device: the Elias-Fano decode tables (_ef_tables)
        self._triton: dict = {}      # the Triton path's task tables (triton_codecs)

    def drop_decode_tables(self) -> None:
        """Free the per-one decode tables and buffers (a plan no longer in use)."""
        self._ef = {}
        self._triton = {}

    def kinds(self) -> dict[str, int]:
        """How many segments use each coding (for reports)."""
        out: dict[str, int] = {}
        for codes in self.segs:
            for s in codes:
                out[s.kind] = out.get(s.kind, 0) + 1
        return out

    # -- owner side ----------------------------------------------------------------------------
    def encode(self, own_bits: torch.Tensor, rank: int, backend: str = "auto") -> torch.Tensor:
        """The owner's shard (``shard_bytes`` uint8) of its bits over its range."""
        shard = torch.zeros(self.shard_bytes, dtype=torch.uint8, device=own_bits.device)
        if self.legacy:
            packed = pack_bits(own_bits, backend=backend)
            shard[:packed.numel()] = packed
            return shard
        lo = self.part.ranges[rank][0]
        if resolve_backend(backend, own_bits) == "triton":
            return _triton_codecs().encode_mask(self.segs[rank], lo, self.shard_bytes, own_bits,
                                                self._triton)
        for s in self.segs[rank]:
            if s.kind == ALL:
                continue
            bits = own_bits[s.flat_start - lo: s.flat_start - lo + s.numel]
            if s.kind == BITMAP:
                shard[s.off:s.off + s.high_bytes] = pack_bits(bits, backend=backend)
                continue
            idx = nonzero_sorted(bits, s.k)          # sorted; k known: no sync on a device
            low = idx if s.kind == INDICES else idx & ((1 << s.width) - 1)
            if s.low_bytes:
                shard[s.off:s.off + s.low_bytes] = _pack_fields(low, s.width, backend)
            if s.kind == ELIAS_FANO:
                upper = torch.zeros(8 * s.high_bytes, dtype=torch.bool, device=bits.device)
                upper.index_fill_(0, (idx >> s.width) + torch.arange(s.k, device=bits.device),
                                  True)
                a = s.off + s.low_bytes
                shard[a:a + s.high_bytes] = pack_bits(upper, backend=backend)
        return shard

    # -- receiver side -------------------------------------------------------------------------
    def decode(self, gathered: torch.Tensor | None, device: torch.device,
               backend: str = "auto") -> torch.Tensor:
        """The full bool mask from every owner's shard (``world·shard_bytes`` uint8)."""
        return self.decode_with_indices(gathered, device, backend)[0]

    def decode_parts(self, gathered: torch.Tensor | None, device: torch.device,
                     backend: str = "auto"
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(mask, indices, bits)``: what the decode makes of every owner's shard. The Triton
        decode (every coding but ``bitmap``, unless the whole plan is all ones): the sorted flat
        indices of the ones and the mask packed 1 bit per element (``pack_bits``'s layout,
        padded to whole 16-byte words), no bool mask. The torch decode: the bool mask, or the
        indices alone when every segment is Elias-Fano coded or all ones."""
        if self.legacy:
            return self._decode_bitmap(gathered, backend), None, None
        probe = gathered if gathered is not None else torch.empty(0, device=device)
        if resolve_backend(backend, probe) == "triton":     # every coding, indices included
            idx, bits = _triton_codecs().decode_mask(self.segs, self.shard_bytes, self.total,
                                                     gathered, device, self._triton)
            return None, idx, bits
        tables = self._device_tables(device)
        if tables["all_ones"]:
            return torch.ones(self.total, dtype=torch.bool, device=device), None, None
        return (*self._decode_torch(tables, gathered, device, backend), None)

    def decode_with_indices(self, gathered: torch.Tensor | None, device: torch.device,
                            backend: str = "auto", with_mask: bool = True
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(mask, indices)``: the full bool mask and the flat indices of its ones in
        increasing order (what ``nonzero_static(mask)`` gives, without the full-size pass), or
        ``None`` for the indices where the decode does not make them (:meth:`decode_parts`).
        ``with_mask=False``: the bool mask is left out (``None``) wherever the indices are made
        -- all the fused step reads."""
        mask, idx, bits = self.decode_parts(gathered, device, backend)
        if mask is None and with_mask:
            assert idx is not None
            mask = (unpack_bits(bits[:packed_numel(self.total)], self.total, backend=backend)
                    if bits is not None else
                    torch.zeros(self.total, dtype=torch.bool, device=device).index_fill_(0, idx,
                                                                                         True))
        return mask, idx

    def _decode_bitmap(self, gathered: torch.Tensor | None, backend: str) -> torch.Tensor:
        """The legacy whole-range format: each owner's packed range, unpacked."""
        assert gathered is not None
        pieces = []
        for r, n in enumerate(self.lengths):
            if n:
                b = gathered[r * self.shard_bytes: r * self.shard_bytes + packed_numel(n)]
                pieces.append(unpack_bits(b, n, backend=backend))
        mask = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.bool)
        if mask.numel() != self.total:
            raise RuntimeError(f"assembled mask has {mask.numel()} bits, expected {self.total}")
        return mask

    def _decode_torch(self, tables: dict, gathered: torch.Tensor | None, device: torch.device,
                      backend: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The decode in torch ops (the CPU, a device without Triton, the plan's fake tensor
        trace): the indices alone when every segment is Elias-Fano coded or all ones,
        else the bool mask."""
        ef_grp = tables[ELIAS_FANO]
        ef = (_ef_tables(self, ef_grp, device) if ef_grp is not None and ef_grp.ones
              else None)
        lean = ef is not None and ef["sorted"] is not None
        mask = None if lean else torch.zeros(self.total, dtype=torch.bool, device=device)
        if mask is not None and tables["implicit"].numel():
            mask.index_fill_(0, tables["implicit"], True)
        if self.shard_bytes == 0:
            return mask, None
        assert gathered is not None
        buf = torch.cat([gathered, gathered.new_zeros(8)])
        for r, codes in enumerate(self.segs):
            for s in codes:
                if s.kind == BITMAP:
                    a = r * self.shard_bytes + s.off
                    mask[s.flat_start:s.flat_start + s.numel] = unpack_bits(
                        gathered[a:a + s.high_bytes], s.numel, backend=backend)
        found, indices = [], None
        grp = tables[INDICES]
        if grp is not None and grp.ones:
            seg = grp.seg_of(grp.k, grp.ones)
            within = torch.arange(grp.ones, device=device) - grp.kcum[seg]
            width = grp.width[seg]
            found.append(grp.flat_start[seg] + _read_fields(buf, grp.low_bit[seg] + within * width,
                                                            width))
        if ef is not None:
            # every position-only quantity (field start bits, widths, offsets) comes from the
            # plan: computed once per plan (see _ef_tables), not per step
            word = buf.index_select(0, ef["byte"]).long()
            for i in range(1, ef["nread"]):
                word |= buf.index_select(0, ef["byte"] + i).long() << (8 * i)
            low = word.bitwise_right_shift_(ef["shift"]).bitwise_and_(ef["low_mask"])
            del word                            # (in place: low is word's storage)
            # the upper bit vectors, concatenated: segment g holds exactly k_g ones, so the
            # j-th one overall belongs to segment g; its high part is pos - (8·hcum_g + j_g)
            bits = unpack_bits(gathered.index_select(0, ef["bidx"]), 8 * ef_grp.high_total,
                               backend=backend)
            pos = nonzero_sorted(bits, ef_grp.ones)
            del bits                            # temporaries go as soon as they are used:
            # the decode's peak is a few index vectors, not every intermediate at once
            pos.sub_(ef["high_base"]).bitwise_left_shift_(ef["width"]).add_(low)
            del low
            found.append(pos.add_(ef["flat_start"]))
            if ef["sorted"] is not None:        # the plan's other segments are all ones
                indices = ef["sorted"].clone().index_copy_(0, ef["dest"], found[-1])
        del buf
        if found and mask is not None:
            mask.index_fill_(0, found[0] if len(found) == 1 else torch.cat(found), True)
        return mask, indices

    def _device_tables(self, device: torch.device) -> dict:
        key = str(device)
        if key not in self._tables:
            flat = [(r, s) for r, codes in enumerate(self.segs) for s in codes]
            implicit = [torch.arange(s.flat_start, s.flat_start + s.numel, device=device)
                        for _, s in flat if s.kind == ALL]
            t: dict = {"all_ones": all(s.kind == ALL for _, s in flat),
                       "implicit": (torch.cat(implicit) if implicit
                                    else torch.zeros(0, dtype=torch.int64, device=device))}
            for kind in (INDICES, ELIAS_FANO):
                segs = [(r, s) for r, s in flat if s.kind == kind]
                t[kind] = _Group(segs, self.shard_bytes, device) if segs else None
            if t["all_ones"]:
                t["implicit"] = torch.zeros(0, dtype=torch.int64, device=device)
            self._tables[key] = t
        return self._tables[key]
