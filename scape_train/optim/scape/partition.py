"""The flat parameter layout and the partition map that gives every element one owner (spec §3).

All parameters are viewed as one flat fp32 space (in ``named_parameters`` order): tensor ``i``
occupies ``[offset_i, offset_i + numel_i)``. A partition map gives each rank one contiguous flat
range ``[lo_r, hi_r)`` -- contiguous under both partitioners -- cut into per-tensor segments
``(tensor_index, start, end)``. The owner computes the next mask on its segments and, in sharded
mode, holds the optimizer state there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PARTITIONERS = ("tensor", "flat")


@dataclass(frozen=True)
class Segment:
    tensor: int       # index into ParamLayout.params
    start: int        # element range inside the (flattened) tensor
    end: int
    flat_start: int   # where ``start`` sits in the flat space

    @property
    def numel(self) -> int:
        return self.end - self.start


class ParamLayout:
    """Names, shapes, flat offsets, masking exclusion and weight decay of every parameter."""

    def __init__(self, model: nn.Module, *, weight_decay: float, exclude_norm_bias: bool):
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.dtype != torch.float32:
                raise TypeError(f"SCAPE keeps fp32 state over fp32 parameters; parameter "
                                f"{name!r} is {p.dtype} (use autocast for bf16 compute)")
            if not p.is_contiguous():
                raise ValueError(f"parameter {name!r} is not contiguous; SCAPE needs flat views")
            self.names.append(name)
            self.params.append(p)
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"SCAPE needs all parameters on one device, got {sorted(map(str, devices))}")
        self.device = self.params[0].device
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]
        # 1-D tensors (biases, norm gains) are sent dense and get no weight decay, as in AdamW.
        self.excluded = [exclude_norm_bias and p.ndim < 2 for p in self.params]
        self.weight_decay = [weight_decay if p.ndim >= 2 else 0.0 for p in self.params]

    def flat_view(self, i: int) -> torch.Tensor:
        return self.params[i].data.view(-1)

    def segments_in(self, lo: int, hi: int) -> list[Segment]:
        """The per-tensor pieces of the flat range ``[lo, hi)``."""
        segs = []
        for i, (a, n) in enumerate(zip(self.offsets, self.numels)):
            s, e = max(lo, a), min(hi, a + n)
            if s < e:
                segs.append(Segment(i, s - a, e - a, s))
        return segs


@dataclass(frozen=True)
class PartitionMap:
    world: int
    ranges: list[tuple[int, int]]        # rank -> [lo, hi) in the flat space
    segments: list[list[Segment]]        # rank -> its segments, in flat order


def build_partition(layout: ParamLayout, world: int, kind: str) -> PartitionMap:
    """``tensor``: whole tensors, contiguous, balanced by count; ``flat``: n equal chunks."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if kind not in PARTITIONERS:
        raise ValueError(f"partitioner must be one of {PARTITIONERS}, got {kind!r}")
    total = layout.total
    if kind == "flat":
        chunk = -(-total // world)  # ceil: the last rank's chunk is the short (padded) one
        ranges = [(min(r * chunk, total), min((r + 1) * chunk, total)) for r in range(world)]
    else:
        # A tensor goes to the rank whose equal share contains its midpoint: monotone in the
        # parameter order (so ranges are contiguous) and within half a tensor of balanced.
        owners = [min(world - 1, int((a + n / 2) * world // total))
                  for a, n in zip(layout.offsets, layout.numels)]
        ranges = []
        for r in range(world):
            mine = [i for i, o in enumerate(owners) if o == r]
            if mine:
                ranges.append((layout.offsets[mine[0]], layout.offsets[mine[-1] + 1]))
            else:  # no tensor for this rank: an empty range at the right place
                before = [i for i, o in enumerate(owners) if o < r]
                at = layout.offsets[before[-1] + 1] if before else 0
                ranges.append((at, at))
    segments = [layout.segments_in(lo, hi) for lo, hi in ranges]
    return PartitionMap(world, ranges, segments)
