"""Analytic bytes per rank per SCAPE step, from a parameter layout alone (no data, no process group).

The figures follow the engines' own construction, piece by piece, with the same helpers they use:
the partition map (:func:`build_partition`), ``k = max(1, floor(d·numel))`` per owned segment
(:func:`mask_counts`, excluded tensors all ones), the mask codings' sizes (:class:`MaskPlan`, every
owner's shard padded to the largest), the payload codec's bytes (:class:`PayloadCodec`) and the
formulas :class:`Comm` counts with. A steady-state step (not the first, whose mask is also gathered
synchronously) sends, with ``P`` the popcount, ``P_r`` its part in owner r's range, ``C(m)`` the
coded bytes of m values (``4m`` in fp32), ``S`` the largest owner's coded mask:

    replicated fp32  payload  all-reduce of the P fp32 values             ring_all_reduce(4P)
    replicated low-p payload  all-to-all of n chunks of w = ceil(P/n)      all_to_all(n·C(w))
                              + all-gather of the reduced chunks           + ring_all_gather(C(w))
    sharded          payload  reduce-scatter (fp32) / all-to-all (low-p)   of n pieces padded to
                              w = max_r P_r:                               (n-1)·C(w) either way
                     norm     all-reduce of one fp32 (the clipping norm)    ring_all_reduce(4)
                     params   all-gather of the owners' new values (fp32)   ring_all_gather(C(w))
                              or coded updates (low-p), padded to w
    every mode       mask     all-gather of S (nothing when S = 0)          ring_all_gather(S)

Because every non-excluded segment holds exactly k ones (spec §2), every size is a function of the
layout, the density, the partition, the coding and the dtype: the counted bytes of a real step
equal these (tests/test_accounting.py and tests/test_wire_dist.py run real multi-rank steps).

Build a layout for a paper-sized model without allocating it: construct the model under
``torch.device("meta")`` and pass it to :class:`ParamLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass

from scape_train.comm import (all_to_all_bytes, ring_all_gather_bytes, ring_all_reduce_bytes,
                    ring_reduce_scatter_bytes)
from .mask_coding import MaskPlan
from .masks import mask_counts
from .partition import ParamLayout, PartitionMap, build_partition
from .payload import PayloadCodec

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


def mask_shard_bytes(part: PartitionMap, layout: ParamLayout | None = None,
                     density: float = 1.0, coding: str = "bitmap") -> int:
    """Bytes each rank contributes to the mask all-gather: the largest owner's coded mask
    (``bitmap``: its packed range; 0 when every segment is known to be all ones)."""
    counts = [] if coding == "bitmap" else mask_counts(part, layout, min(density, 1.0))
    return MaskPlan(part, layout, counts, coding, layout.total if layout else 0).shard_bytes


def scape_step_bytes(layout: ParamLayout, world: int, density: float, *,
                     partitioner: str = "tensor", sharded: bool = False,
                     mask_coding: str = "auto", payload_dtype: str = "fp32") -> StepBytes:
    """Bytes one rank sends in a steady-state SCAPE step (see the module docstring). The
    defaults are the optimizer config's."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if world <= 1:
        return StepBytes()
    part = build_partition(layout, world, partitioner)
    counts = owner_popcounts(layout, part, density)
    codec = PayloadCodec(payload_dtype)
    # The next mask is gathered every step (bitmap: even at density 1, when it is all ones).
    mask = ring_all_gather_bytes(mask_shard_bytes(part, layout, density, mask_coding), world)
    if not sharded:
        if not codec.lowp:
            return StepBytes(payload=ring_all_reduce_bytes(FP32_BYTES * sum(counts), world),
                             mask=mask)
        chunk = codec.nbytes(max(1, -(-sum(counts) // world)))
        return StepBytes(payload=all_to_all_bytes(world * chunk, world)
                         + ring_all_gather_bytes(chunk, world), mask=mask)
    width = max(1, max(counts))
    piece = codec.nbytes(width)
    payload = (all_to_all_bytes(world * piece, world) if codec.lowp
               else ring_reduce_scatter_bytes(world * piece, world))
    return StepBytes(payload=payload, mask=mask, params=ring_all_gather_bytes(piece, world),
                     norm=ring_all_reduce_bytes(FP32_BYTES, world))


def dense_allreduce_bytes(layout: ParamLayout, world: int, itemsize: int = FP32_BYTES) -> int:
    """Bytes one rank sends in the dense gradient all-reduce (DDP, ring) of the same layout, fp32
    (``itemsize=2``: a bf16 all-reduce, DDP's bf16 compression hook).

    DDP splits the gradient into buckets; the ring formula's integer division per bucket makes the
    logged figure smaller by at most a few bytes per bucket.
    """
    return ring_all_reduce_bytes(itemsize * layout.total, world)
