"""What a strategy hands the checkpoint: its state split by who writes it.

``replicated`` (identical on every rank: rank 0 writes it, every rank reads it), ``per_rank`` (this
rank's own) and ``sharded`` (a :class:`FlatShard`: the flat range this rank owns). On load the
sharded state comes back through a :class:`ShardSource`, which serves any flat range from
whichever owners hold it, so a strategy built for another world size or partition reshards by
asking for its own range. See ``scape_train/checkpoint_layout.py`` for the files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch


@dataclass
class FlatShard:
    """The flat range ``[lo, hi)`` of a flat space of ``total`` elements, as one owner holds it:
    ``tensors`` maps a name (``momentum``...) to a 1-D tensor of ``hi - lo`` elements."""

    lo: int
    hi: int
    total: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if not 0 <= self.lo <= self.hi <= self.total:
            raise ValueError(f"flat shard [{self.lo}, {self.hi}) outside [0, {self.total})")
        for name, t in self.tensors.items():
            if t.dim() != 1 or t.numel() != self.hi - self.lo:
                raise ValueError(f"flat shard tensor {name!r} has shape {tuple(t.shape)}, expected "
                                 f"({self.hi - self.lo},) for [{self.lo}, {self.hi})")

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def to_dict(self) -> dict[str, Any]:
        return {"lo": self.lo, "hi": self.hi, "total": self.total, "tensors": dict(self.tensors)}


@dataclass
class StateParts:
    """A strategy's (or the trainer's) state, split by who writes it (module docstring)."""

    replicated: dict[str, Any] = field(default_factory=dict)
    per_rank: dict[str, Any] = field(default_factory=dict)
    sharded: FlatShard | None = None


class ShardSource(Protocol):
    """Where a loader finds owner-sharded state: any flat range, from whichever owners hold it."""

    def read(self, name: str, lo: int, hi: int, total: int) -> torch.Tensor | None:
        """``name`` over ``[lo, hi)`` of a ``total``-element flat space as a CPU tensor, or None
        when the checkpoint holds no sharded ``name``."""


class MemoryShards:
    """A :class:`ShardSource` over in-memory shards (tests, and state handed over in-process)."""

    def __init__(self, shards: list[FlatShard]):
        self.shards = sorted((s for s in shards if s.numel), key=lambda s: s.lo)

    def read(self, name: str, lo: int, hi: int, total: int) -> torch.Tensor | None:
        return assemble_range(((s.lo, s.hi, s.total, s.tensors) for s in self.shards
                               if name in s.tensors), name, lo, hi, total)


def assemble_range(pieces: Iterator[tuple[int, int, int, Any]], name: str, lo: int, hi: int,
                   total: int) -> torch.Tensor | None:
    """``name`` over ``[lo, hi)`` from owner pieces ``(a, b, total, tensors)`` sorted by ``a``
    (``tensors`` a dict, or a callable returning it, read only when the piece overlaps)."""
    found, out, at = False, [], lo
    for a, b, t_total, tensors in pieces:
        found = True
        if t_total != total:
            raise ValueError(f"sharded {name!r} covers a flat space of {t_total} elements, this "
                             f"model has {total}")
        s, e = max(lo, a), min(hi, b)
        if s >= e:
            continue
        if s != at:
            raise ValueError(f"sharded {name!r}: no owner holds [{at}, {s})")
        data = tensors() if callable(tensors) else tensors
        out.append(data[name][s - a:e - a])
        at = e
    if not found:
        return None
    if at != hi:
        raise ValueError(f"sharded {name!r}: no owner holds [{at}, {hi})")
    return torch.cat(out) if out else torch.zeros(0)
