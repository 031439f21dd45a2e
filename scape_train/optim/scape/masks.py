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

from ..comm import Comm, Handle
from ..density import segment_k
from . import native
from .kernels import host_reads_ok, nonzero_sorted
from .mask_coding import MaskPlan
from .partition import ParamLayout, PartitionMap


# CPU top-k by threshold selection (top_k_indices, where kernels.host_reads_ok): a device's
# torch.topk is a radix select with no host read; the CPU's sorts (value, index) pairs of its
# whole input, the largest CPU item of a SCAPE step.
_SAMPLE_ONES = 256      # expected ones of the mask in the threshold's sample
_OVERSHOOT = 1.25       # the threshold keeps ~1.25k candidates: below k only ~4 sigma away
_samples: dict[tuple[int, int], torch.Tensor] = {}


def _sample(a: torch.Tensor, k: int) -> torch.Tensor | None:
    """The threshold's sample of positions for a top-k of ``k`` of ``a`` (fixed per shape: the
    selection is a function of ``a`` only), or ``None`` where the threshold does not pay: on a
    device (no host reads), or for a dense pick."""
    n = a.numel()
    size = min(n, _SAMPLE_ONES * n // max(k, 1))
    if not host_reads_ok(a) or 8 * k > n or size >= n // 2:
        return None
    key = (n, size)
    if key not in _samples:
        if len(_samples) > 256:
            _samples.clear()
        gen = torch.Generator().manual_seed(n)
        _samples[key] = torch.randint(n, (size,), generator=gen)
    return _samples[key]


def _top_k_bits_native(lib, stat: torch.Tensor, k: int, bits: torch.Tensor) -> bool:
    """The C top-k (native/scape_cpu.c: the same sampled threshold, then one pass to collect
    the candidates' |c|, a radix selection, one pass writing the bits): ``bits`` set to exactly the
    k largest ``|stat|`` (no abs copy, no index vectors); False where it does not apply."""
    sample = _sample(stat, k)
    if sample is None or not stat.is_contiguous():
        return False
    rank = int(_SAMPLE_ONES * _OVERSHOOT)
    cap = max(2 * k, sample.numel()) + 64
    work = torch.empty(cap, dtype=torch.float32)
    return lib.scape_topk_bits(native.ptr(stat), stat.numel(), k, native.ptr(sample),
                               sample.numel(), rank - 1, native.ptr(bits), native.ptr(work),
                               cap) == 0


def top_k_indices(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (in no order) of the ``k`` largest entries of the non-negative ``a``: exactly
    ``torch.topk(a, k).indices`` as a set (the same values; ties broken either way).

    On the CPU: a threshold from a fixed pseudo-random sample (its ``_OVERSHOOT·k``-th largest,
    scaled), every entry at or above it (~1.25k candidates, counted: a host read, which on the CPU
    stalls nothing), and torch.topk over the candidates only; if the sample's threshold left fewer
    than k, torch.topk over all. A few linear passes instead of a sort of the whole segment."""
    sample_idx = _sample(a, k)
    if sample_idx is None:         # a dense pick (or a device): topk's sort
        return torch.topk(a, k, sorted=False).indices
    sample = a.index_select(0, sample_idx)
    threshold = torch.topk(sample, int(_SAMPLE_ONES * _OVERSHOOT), sorted=False).values.min()
    keep = a >= threshold
    m = int(torch.count_nonzero(keep))
    if m < k:
        return torch.topk(a, k, sorted=False).indices
    cand = nonzero_sorted(keep, m)
    return cand.index_select(0, torch.topk(a.index_select(0, cand), k, sorted=False).indices)


def topk_own_mask(stat_own: torch.Tensor, part: PartitionMap, rank: int, layout: ParamLayout,
                  density: float) -> torch.Tensor:
    """The owner's bits over its range ``[lo, hi)``: top-k of ``|stat|`` per segment."""
    lo, hi = part.ranges[rank]
    bits = torch.zeros(hi - lo, dtype=torch.bool, device=stat_own.device)
    lib = native.lib(stat_own) if stat_own.dtype == torch.float32 else None
    for seg in part.segments[rank]:
        a = seg.flat_start - lo
        piece = bits[a:a + seg.numel]
        k = segment_k(seg.numel, density)
        if layout.excluded[seg.tensor] or k >= seg.numel:
            piece.fill_(True)
        elif lib is None or not _top_k_bits_native(lib, stat_own[a:a + seg.numel], k, piece):
            piece.index_fill_(0, top_k_indices(stat_own[a:a + seg.numel].abs(), k), True)
    return bits


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


class PendingMask:
    """An in-flight next-mask all-gather; :meth:`wait` returns the full bool mask."""

    def __init__(self, handle: Handle | None, gathered: torch.Tensor | None,
                 exchange: "MaskExchange", ready: torch.Tensor | None = None,
                 plan: MaskPlan | None = None):
        self._handle, self._gathered, self._exchange = handle, gathered, exchange
        self._plan = plan
        self._mask = ready
        self.indices: torch.Tensor | None = None   # the mask's sorted flat indices, if decoded

    def wait(self) -> torch.Tensor:
        if self._mask is None:
            assert self._handle is not None and self._gathered is not None
            self._handle.wait()
            self._mask, self.indices = self._exchange.assemble_with_indices(self._gathered,
                                                                             self._plan)
            self._gathered = None
        return self._mask

    @classmethod
    def ready(cls, mask: torch.Tensor, exchange: "MaskExchange") -> "PendingMask":
        return cls(None, None, exchange, ready=mask)


class MaskExchange:
    """Codes an owner's bits (:mod:`.mask_coding`), all-gathers every owner's bytes (kind
    ``mask``), reassembles the full mask.

    ``coding="bitmap"`` (the packed owner range, spec §4) needs no layout; the other codings are
    per segment and need ``layout`` and the density the mask was built at (its ``k`` per segment),
    from which every rank derives the same sizes (:class:`MaskPlan`)."""

    def __init__(self, part: PartitionMap, comm: Comm, total: int, backend: str = "auto", *,
                 layout: ParamLayout | None = None, coding: str = "bitmap"):
        self.part, self.comm, self.total, self.backend = part, comm, total, backend
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
            return PendingMask.ready(plan.decode(None, own_bits.device, self.backend), self)
        shard = plan.encode(own_bits, rank, self.backend)
        gathered = torch.empty(plan.shard_bytes * self.comm.world, dtype=torch.uint8,
                               device=own_bits.device)
        handle = self.comm.all_gather(gathered, shard, kind="mask", async_op=async_op)
        return PendingMask(handle, gathered, self, plan=plan)

    def assemble_with_indices(self, gathered: torch.Tensor, plan: MaskPlan | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(mask, indices or None)``: see :meth:`MaskPlan.decode_with_indices`."""
        plan = plan if plan is not None else self.plan(1.0)
        if plan.legacy:
            return plan.decode(gathered, gathered.device, self.backend), None
        return plan.decode_with_indices(gathered, gathered.device, self.backend)

    def assemble(self, gathered: torch.Tensor, plan: MaskPlan | None = None) -> torch.Tensor:
        plan = plan if plan is not None else self.plan(1.0)
        return plan.decode(gathered, gathered.device, self.backend)
