"""Analytic bytes per rank per SCAPE step, from a parameter layout alone (no data, no process group).

The figures follow the engines' own construction, piece by piece, with the same helpers they use:
the partition map (:func:`build_partition`), ``k = max(1, floor(d·numel))`` per owned segment
(:func:`segment_k`, excluded tensors all ones), packed mask bytes (:func:`packed_numel`, every
owner's shard padded to the largest) and the ring formulas :class:`Comm` counts with. A
steady-state step (not the first, whose mask is also gathered synchronously) sends:

    replicated  payload  all-reduce of the popcount P fp32 values          ring_all_reduce(4P)
                mask     all-gather of the largest packed owner range       ring_all_gather(B)
    sharded     payload  reduce-scatter of n pieces padded to w = max_r P_r ring_reduce_scatter(4nw)
                norm     all-reduce of one fp32 (the global clipping norm)   ring_all_reduce(4)
                params   all-gather of the owners' new values, padded to w  ring_all_gather(4w)
                mask     as replicated

Because every non-excluded segment holds exactly k ones (spec §2), P and the per-owner P_r are
functions of the layout, the density and the partition: the counted bytes of a real step equal
these (tests/test_accounting.py runs real multi-rank steps and compares).

Build a layout for a paper-sized model without allocating it: construct the model under
``torch.device("meta")`` and pass it to :class:`ParamLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm import ring_all_gather_bytes, ring_all_reduce_bytes, ring_reduce_scatter_bytes
from .kernels import packed_numel
from .masks import mask_counts
from .partition import ParamLayout, PartitionMap, build_partition

FP32_BYTES = 4


@dataclass(frozen=True)
class StepBytes:
    """Bytes one rank sends in one steady-state step, by the kinds :class:`Comm` logs."""

    payload: int = 0
    mask: int = 0
    params: int = 0
    norm: int = 0

    @property
    def total(self) -> int:
        return self.payload + self.mask + self.params + self.norm

    def as_dict(self) -> dict[str, int]:
        return {"payload": self.payload, "mask": self.mask, "params": self.params,
                "norm": self.norm, "total": self.total}


def owner_popcounts(layout: ParamLayout, part: PartitionMap, density: float) -> list[int]:
    """Ones of the mask in each owner's range: ``k`` per segment, all of an excluded one."""
    return [sum(c) for c in mask_counts(part, layout, density)]


def mask_shard_bytes(part: PartitionMap) -> int:
    """Bytes each rank contributes to the mask all-gather (the largest packed owner range)."""
    return max(1, max(packed_numel(hi - lo) for lo, hi in part.ranges))


def scape_step_bytes(layout: ParamLayout, world: int, density: float, *,
                     partitioner: str = "tensor", sharded: bool = False) -> StepBytes:
    """Bytes one rank sends in a steady-state SCAPE step (see the module docstring)."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if world <= 1:
        return StepBytes()
    part = build_partition(layout, world, partitioner)
    counts = owner_popcounts(layout, part, density)
    # The next mask is gathered every step, even at density 1 (then it is all ones).
    mask = ring_all_gather_bytes(mask_shard_bytes(part), world)
    if not sharded:
        return StepBytes(payload=ring_all_reduce_bytes(FP32_BYTES * sum(counts), world), mask=mask)
    width = max(1, max(counts))
    return StepBytes(payload=ring_reduce_scatter_bytes(FP32_BYTES * world * width, world),
                     mask=mask, params=ring_all_gather_bytes(FP32_BYTES * width, world),
                     norm=ring_all_reduce_bytes(FP32_BYTES, world))


def dense_allreduce_bytes(layout: ParamLayout, world: int) -> int:
    """Bytes one rank sends in the dense fp32 gradient all-reduce (DDP, ring) of the same layout.

    DDP splits the gradient into buckets; the ring formula's integer division per bucket makes the
    logged figure smaller by at most a few bytes per bucket.
    """
    return ring_all_reduce_bytes(FP32_BYTES * layout.total, world)
