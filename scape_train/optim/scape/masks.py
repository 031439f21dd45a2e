"""Mask building (top-k per owned segment) and the packed-bit all-gather of the next mask.

Each owner selects ``k = max(1, floor(d·numel))`` entries of ``|c|`` per segment; excluded tensors
(biases, norm gains) are all ones. The owners' bits travel coded (:mod:`.mask_coding`: packed bits,
or the sorted indices per segment, whichever is smallest; sizes known to every rank) in ONE
all-gather, started asynchronously at the end of step t and waited on inside step t+1, so that it
overlaps the forward and backward passes. Ranks own contiguous flat ranges, so the global mask is
the concatenation of the owners' pieces: no union fill-in.
"""

from __future__ import annotations

import torch

from scape_train.comm import Comm, Handle
from ..density import segment_k
from .kernels import nonzero_sorted, topk_segments
from .mask_coding import MaskPlan
from .mask_format import bits_bytes
from .partition import ParamLayout, PartitionMap


def own_segments(part: PartitionMap, rank: int, layout: ParamLayout, density: float
                 ) -> tuple[tuple[int, int, int], ...]:
    """The owner's top-k segments ``(start in its range, numel, k)`` at ``density``: ``k =
    segment_k(numel, d)``, all ones (``k = numel``) on excluded tensors."""
    lo = part.ranges[rank][0]
    return tuple((seg.flat_start - lo, seg.numel,
                  seg.numel if layout.excluded[seg.tensor] else segment_k(seg.numel, density))
                 for seg in part.segments[rank])


def topk_own_mask(stat_own: torch.Tensor, part: PartitionMap, rank: int, layout: ParamLayout,
                  density: float, lib=None,
                  segments: tuple[tuple[int, int, int], ...] | None = None) -> torch.Tensor:
    """The owner's bits over its range ``[lo, hi)``: top-k of ``|stat|`` per segment (among equal
    values the lowest indices: :func:`.kernels.topk_segments`' rule on every path), by the
    passes ``lib`` (:func:`.strategy.select_passes`: every segment in a few Triton launches,
    or a ``torch.topk`` per segment; default the torch one). ``segments``: the
    :func:`own_segments` of this rank and density, where the caller keeps them."""
    if segments is None:
        segments = own_segments(part, rank, layout, density)
    return (topk_segments if lib is None else lib.topk_mask)(stat_own, segments)


def mask_counts(part: PartitionMap, layout: ParamLayout, density: float) -> list[list[int]]:
    """The ones of a mask built at ``density`` on every segment of every rank, known on the host
    in advance (what :func:`topk_own_mask` selects): no device read is needed for any size."""
    return [[seg.numel if layout.excluded[seg.tensor] else segment_k(seg.numel, density)
             for seg in segs] for segs in part.segments]


def measured_counts(mask: torch.Tensor, part: PartitionMap) -> list[list[int]]:
    """The ones of ``mask`` on every segment, read from the device (one host sync): for a mask
    that was not built under this partition (a checkpoint from another world size)."""
    segs = [s for rank_segs in part.segments for s in rank_segs]
    flat = (torch.stack([torch.count_nonzero(mask[s.flat_start:s.flat_start + s.numel])
                         for s in segs]).tolist() if segs else [])
    out, i = [], 0
    for rank_segs in part.segments:
        out.append(flat[i:i + len(rank_segs)])
        i += len(rank_segs)
    return out


class Mask:
    """A mask M_t as the step holds it: the sorted flat indices of its ones (with the mask
    packed 1 bit per element beside them), its full bool tensor, or both.

    The Triton decode gives the indices and the packed bits and writes no bool tensor: the
    fused step walks the indices, the next step's overlap metric reads the bits (1/8 byte per
    element), so no byte-per-element mask is held across steps. The bool form -- what the
    reference engines, checkpoints and the legacy ``bitmap`` coding use -- is made from the
    indices on demand by :meth:`dense`; at the end of each step the strategy keeps the smaller
    of the two forms (:meth:`keep_one_form`)."""

    def __init__(self, total: int, *, dense: torch.Tensor | None = None,
                 indices: torch.Tensor | None = None, bits: torch.Tensor | None = None):
        if dense is None and indices is None:
            raise ValueError("a Mask needs its bool tensor or its indices")
        if dense is not None and dense.numel() != total:
            raise ValueError(f"a mask of {total} elements, got {dense.numel()} bits")
        if bits is not None and indices is None:
            raise ValueError("a Mask's packed bits come with its indices")
        self.total = total
        self._dense, self.indices, self.bits, self._made = dense, indices, bits, False
        self._indexed = False

    @classmethod
    def of(cls, dense: "torch.Tensor | Mask | None") -> "Mask | None":
        """``dense`` (a bool tensor, or already a Mask) as a Mask."""
        if dense is None or isinstance(dense, Mask):
            return dense
        return cls(dense.numel(), dense=dense)

    def dense(self, keep: bool = True) -> torch.Tensor:
        """The full bool tensor: the one held, else made from the indices (one zero fill, one
        index fill), kept for the next call unless ``keep`` is false."""
        if self._dense is not None:
            return self._dense
        assert self.indices is not None
        out = torch.zeros(self.total, dtype=torch.bool, device=self.indices.device)
        out.index_fill_(0, self.indices, True)
        if keep:
            self._dense, self._made = out, True
        return out

    def keep_one_form(self) -> None:
        """Keep one form between steps: the indices when the fused step walked them (its engine
        holds them anyway as m's support), when no bool tensor was made from them, or when they
        are the smaller (8 bytes per one against 1 per element: a mask under 1/8 dense); else
        the bool tensor (a reference step at a warm-up's high density)."""
        if self._indexed:     # indices made from the bool tensor: the fused engine holds them
            self._dense, self._indexed = None, False
            return
        if not self._made:
            return
        assert self.indices is not None and self._dense is not None
        if 8 * self.indices.numel() > self.total:
            self.indices = self.bits = None   # the bool tensor is the mask now
        else:
            self._dense = None
        self._made = False

    def index(self, count: int) -> torch.Tensor:
        """The ``count`` flat indices of the ones, increasing: the decode's, else one
        ``nonzero_static`` pass over the bool tensor (kept: the fused step reads them again as
        the next step's previous mask)."""
        if self.indices is None or self.indices.numel() != count:
            self.indices, self.bits = nonzero_sorted(self.dense(), count), None
            self._indexed = True
        return self.indices


def overlap(cur: Mask, prev: Mask, lib) -> torch.Tensor:
    """Ones of ``cur`` that ``prev`` has too (the masks' temporal stability metric), as a
    tensor: from the index lists when both have them, O(k) in the passes ``lib``
    (:func:`.strategy.select_passes`): ``cur``'s looked up in ``prev``'s packed bits, the decode's
    or marked in a scratch bitmap. Else one full-size AND of the bool tensors."""
    a, b = cur.indices, prev.indices
    if a is None or b is None:
        return torch.count_nonzero(cur.dense(keep=False) & prev.dense(keep=False))
    if not a.numel() or not b.numel():
        return torch.zeros((), dtype=torch.int64, device=a.device)
    if prev.bits is not None:           # marked by the decode: the lookups only
        return lib.count_common(a.contiguous(), None, prev.bits)
    bits = torch.empty(bits_bytes(cur.total), dtype=torch.uint8, device=a.device)
    return lib.count_common(a.contiguous(), b.contiguous(), bits)


class PendingMask:
    """An in-flight next-mask all-gather; :meth:`mask` returns the decoded :class:`Mask`."""

    def __init__(self, handle: Handle | None, gathered: torch.Tensor | None,
                 exchange: "MaskExchange", ready: "torch.Tensor | Mask | None" = None,
                 plan: MaskPlan | None = None):
        self._handle, self._gathered, self._exchange = handle, gathered, exchange
        self._plan = plan
        self._mask = Mask.of(ready)

    def mask(self) -> Mask:
        """The mask, once gathered and decoded (waits for the all-gather)."""
        if self._mask is None:
            assert self._handle is not None and self._gathered is not None
            self._handle.wait()
            self._mask = self._exchange.assemble_mask(self._gathered, self._plan)
            self._gathered = None
        return self._mask

    def wait(self) -> torch.Tensor:
        """The full bool mask (made from the indices, not kept)."""
        return self.mask().dense(keep=False)

    @classmethod
    def ready(cls, mask: "torch.Tensor | Mask", exchange: "MaskExchange") -> "PendingMask":
        return cls(None, None, exchange, ready=mask)


class MaskExchange:
    """Codes an owner's bits (:mod:`.mask_coding`), all-gathers every owner's bytes (kind
    ``mask``), reassembles the full mask.

    ``coding="bitmap"`` (the packed owner range, spec §4) needs no layout; the other codings are
    per segment and need ``layout`` and the density the mask was built at (its ``k`` per segment),
    from which every rank derives the same sizes (:class:`MaskPlan`)."""

    def __init__(self, part: PartitionMap, comm: Comm, total: int, lib, *,
                 layout: ParamLayout | None = None, coding: str = "bitmap"):
        self.part, self.comm, self.total, self.lib = part, comm, total, lib
        self.layout, self.coding = layout, coding
        self.lengths = [hi - lo for lo, hi in part.ranges]
        self._plans: dict[float, MaskPlan] = {}
        if coding == "bitmap":
            # Uneven ranges: every rank sends the largest packed length; the padding is counted.
            self.shard_bytes = self.plan(1.0).shard_bytes
        elif layout is None:
            raise ValueError(f"mask_coding={coding!r} needs the parameter layout")

    def plan(self, density: float) -> MaskPlan:
        """The codings of a mask built at ``density`` (cached; the warm-up visits each once)."""
        density = min(float(density), 1.0)
        if density not in self._plans:
            if len(self._plans) > 64:
                self._plans.clear()
            for old in self._plans.values():   # per-one decode tables: the newest plan only
                old.drop_decode_tables()
            counts = ([] if self.coding == "bitmap"
                      else mask_counts(self.part, self.layout, density))
            self._plans[density] = MaskPlan(self.part, self.layout, counts, self.coding,
                                            self.total)
        return self._plans[density]

    def shard_bytes_at(self, density: float) -> int:
        """Bytes each rank contributes to the all-gather of a mask built at ``density`` (0: no
        gather, every segment is known to be all ones)."""
        return self.plan(density).shard_bytes

    def start(self, own_bits: torch.Tensor, density: float = 1.0, async_op: bool = True
              ) -> PendingMask:
        """Start gathering the mask built at ``density`` from every owner's ``own_bits``."""
        rank = self.comm.rank
        if own_bits.numel() != self.lengths[rank]:
            raise ValueError(f"rank {rank} owns {self.lengths[rank]} elements, got "
                             f"{own_bits.numel()} mask bits")
        plan = self.plan(density)
        if plan.shard_bytes == 0:           # all ones everywhere: nothing to send
            return PendingMask.ready(self.assemble_mask(None, plan, own_bits.device), self)
        shard = plan.encode(own_bits, rank, self.lib)
        gathered = torch.empty(plan.shard_bytes * self.comm.world, dtype=torch.uint8,
                               device=own_bits.device)
        handle = self.comm.all_gather(gathered, shard, kind="mask", async_op=async_op)
        return PendingMask(handle, gathered, self, plan=plan)

    def assemble_mask(self, gathered: torch.Tensor | None, plan: MaskPlan | None = None,
                      device: torch.device | None = None) -> Mask:
        """The :class:`Mask` from every owner's shard (none: a plan of all ones): its indices
        and packed bits where the decode gives them (no bool tensor written), else its bool
        tensor (:meth:`MaskPlan.decode`)."""
        dense, idx, bits = (plan or self.plan(1.0)).decode(
            gathered, device or gathered.device, self.lib)
        return Mask(self.total, dense=dense, indices=idx, bits=bits)
