"""SCAPE: sparse-communication data-parallel optimizer (AdamS momentum top-k with error feedback)."""

from .partition import PARTITIONERS, ParamLayout, PartitionMap, Segment, build_partition
from .strategy import ScapeStrategy

__all__ = ["PARTITIONERS", "ParamLayout", "PartitionMap", "Segment", "ScapeStrategy",
           "build_partition"]
