"""The mask codings (:mod:`.mask_format`) in torch ops: the CPU path, a device without Triton, the
memory plan's fake-tensor trace, and the oracle :mod:`.triton_codecs` is tested against, bit for
bit. Reached through :class:`.torch_passes.TorchPasses`.

Decoding is vectorised over all segments of all owners (a fixed number of device ops per step,
whatever the number of segments); encoding runs per owned segment, beside the top-k. Sizes come
from the host-known plan: nothing is read back from the device.
"""

from __future__ import annotations

import torch

from ...host_to_device import upload
from .kernels import nonzero_sorted, pack_bits, unpack_bits
from .mask_format import ALL, BITMAP, ELIAS_FANO, INDICES, SegCode


def _pack_fields(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative int64 ``values`` as ``width``-bit little-endian fields, bit-packed."""
    shifts = torch.arange(width, device=values.device)
    return pack_bits(((values.unsqueeze(1) >> shifts) & 1).bool().reshape(-1))


def _read_fields(buf: torch.Tensor, byte: torch.Tensor, shift: torch.Tensor,
                 low_mask: torch.Tensor, nread: int = 5) -> torch.Tensor:
    """Fields at bit ``8·byte + shift`` of uint8 ``buf`` (padded by 8 bytes so that a read never
    runs past its end), ``nread`` bytes each (5 cover any field of ≤ 33 bits), masked."""
    word = buf.index_select(0, byte).long()
    for i in range(1, nread):
        word |= buf.index_select(0, byte + i).long() << (8 * i)
    return word.bitwise_right_shift_(shift).bitwise_and_(low_mask)


def _ones_below(width: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_left_shift(torch.ones_like(width), width) - 1


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

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per one: its segment, its rank in it, its field's first bit and its width."""
        seg = self.seg_of(self.k, self.ones)
        within = torch.arange(self.ones, device=self.k.device) - self.kcum[seg]
        width = self.width[seg]
        return seg, within, self.low_bit[seg] + within * width, width


def _ef_tables(plan, grp: _Group, device: torch.device) -> dict:
    """Per-one constants of a plan's Elias-Fano group: where each one's low field starts (byte,
    bit shift), its width, mask, segment start and high-part offset, and the byte index of the
    concatenated upper vectors. Cached for the newest plan only (the warm-up visits each
    density once): ~7 int64 per one, plus the sorted-index template (one int64 per
    one of the whole mask) -- state the memory plan counts (plan/optimizer_memory.py)."""
    key = ("torch_ef", str(device))
    if key in plan.cache:
        return plan.cache[key]
    seg, within, start, width = grp.fields()
    bseg = grp.seg_of(grp.high_bytes, grp.high_total)
    max_w = max((s.width for codes in plan.segs for s in codes if s.kind == ELIAS_FANO),
                default=0)                                  # from the host plan: no read back
    # int64 throughout: a narrower shift or width would be converted at every decode
    t = {"byte": start >> 3, "shift": start & 7, "width": width, "low_mask": _ones_below(width),
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
    plan.cache[key] = t
    return t


def _device_tables(plan, device: torch.device) -> dict:
    key = ("torch", str(device))
    if key not in plan.cache:
        flat = [(r, s) for r, codes in enumerate(plan.segs) for s in codes]
        all_ones = all(s.kind == ALL for _, s in flat)
        implicit = [torch.arange(s.flat_start, s.flat_start + s.numel, device=device)
                    for _, s in flat if s.kind == ALL and not all_ones]
        t: dict = {"all_ones": all_ones,
                   "implicit": (torch.cat(implicit) if implicit
                                else torch.zeros(0, dtype=torch.int64, device=device))}
        for kind in (INDICES, ELIAS_FANO):
            segs = [(r, s) for r, s in flat if s.kind == kind]
            t[kind] = _Group(segs, plan.shard_bytes, device) if segs else None
        plan.cache[key] = t
    return plan.cache[key]


def encode_mask(plan, own_bits: torch.Tensor, rank: int) -> torch.Tensor:
    """The owner's shard (``plan.shard_bytes`` uint8) of its bits over its range."""
    shard = torch.zeros(plan.shard_bytes, dtype=torch.uint8, device=own_bits.device)
    lo = plan.part.ranges[rank][0]
    for s in plan.segs[rank]:
        if s.kind == ALL:
            continue
        bits = own_bits[s.flat_start - lo: s.flat_start - lo + s.numel]
        if s.kind == BITMAP:
            shard[s.off:s.off + s.high_bytes] = pack_bits(bits)
            continue
        idx = nonzero_sorted(bits, s.k)          # sorted; k known: no sync on a device
        low = idx if s.kind == INDICES else idx & ((1 << s.width) - 1)
        if s.low_bytes:
            shard[s.off:s.off + s.low_bytes] = _pack_fields(low, s.width)
        if s.kind == ELIAS_FANO:
            upper = torch.zeros(8 * s.high_bytes, dtype=torch.bool, device=bits.device)
            upper.index_fill_(0, (idx >> s.width) + torch.arange(s.k, device=bits.device), True)
            a = s.off + s.low_bytes
            shard[a:a + s.high_bytes] = pack_bits(upper)
    return shard


def decode_mask(plan, gathered: torch.Tensor | None, device: torch.device
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    """``(mask, indices, None)`` from every owner's shard: the indices alone (sorted) when every
    segment is Elias-Fano coded or all ones, else the bool mask."""
    tables = _device_tables(plan, device)
    if tables["all_ones"]:
        return torch.ones(plan.total, dtype=torch.bool, device=device), None, None
    ef_grp = tables[ELIAS_FANO]
    ef = _ef_tables(plan, ef_grp, device) if ef_grp is not None and ef_grp.ones else None
    lean = ef is not None and ef["sorted"] is not None
    mask = None if lean else torch.zeros(plan.total, dtype=torch.bool, device=device)
    if mask is not None and tables["implicit"].numel():
        mask.index_fill_(0, tables["implicit"], True)
    if plan.shard_bytes == 0:
        return mask, None, None
    assert gathered is not None
    buf = torch.cat([gathered, gathered.new_zeros(8)])
    for r, codes in enumerate(plan.segs):
        for s in codes:
            if s.kind == BITMAP:
                a = r * plan.shard_bytes + s.off
                mask[s.flat_start:s.flat_start + s.numel] = unpack_bits(
                    gathered[a:a + s.high_bytes], s.numel)
    found, indices = [], None
    grp = tables[INDICES]
    if grp is not None and grp.ones:
        seg, _, start, width = grp.fields()
        found.append(grp.flat_start[seg] + _read_fields(buf, start >> 3, start & 7,
                                                        _ones_below(width)))
    if ef is not None:
        # every position-only quantity (field start bits, widths, offsets) comes from the
        # plan: computed once per plan (see _ef_tables), not per step
        low = _read_fields(buf, ef["byte"], ef["shift"], ef["low_mask"], ef["nread"])
        # the upper bit vectors, concatenated: segment g holds exactly k_g ones, so the
        # j-th one overall belongs to segment g; its high part is pos - (8·hcum_g + j_g)
        bits = unpack_bits(gathered.index_select(0, ef["bidx"]), 8 * ef_grp.high_total)
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
    return mask, indices, None
