"""What a checkpoint holds, which rank writes each piece, and how many bytes that is.

The seam between the optimizer strategies (and the trainer) and the generic
:class:`~scape_train.checkpoint.CheckpointManager`. State comes in three kinds:

    replicated  identical on every rank -- the model, dense optimizer state under DDP, SCAPE's
                replicated-mode momentum and the masks, the train counters: written ONCE, by
                rank 0, into ``replicated.pt`` (the model into ``model.pt``); read by every rank
    sharded     owner-sharded over one flat space -- SCAPE's sharded-mode ``m`` and ``rho``: each
                owner writes the flat range ``[lo, hi)`` it covers (``shard_XXXXX.pt``); a loader
                reads the ranges it needs from the owners' files, so another world size or
                partition reshards on load
    per_rank    this rank's own -- residuals (SCAPE ``e``/``eps``, top-k), the data cursor, RNG,
                DiLoCo/GASLoC inner state: written by its rank (``rank_XXXXX.pt``)

A strategy declares the split with ``checkpoint_state() -> StateParts``; the trainer adds its own
pieces with :func:`trainer_parts`; :func:`checkpoint_files` maps one rank's pieces to the files it
writes. The save calls that function for what it writes, and :func:`state_bytes` counts each
file's tensor bytes as ``torch.save`` writes them (every distinct storage once, whole), so the
accounting in the manifest (``bytes``) is that of the save itself. Nothing is gathered to be
saved, and tensors stay where they live until written: ``torch.save`` copies each storage to the
host as it writes it (views of a flat state tensor are written as that one storage).

The same functions run on meta-device models and strategies built with :class:`AccountingComm`
(an assumed world size and rank, no process group), which is how ``scripts/bench_checkpoint.py``
sizes checkpoints of models that need not fit here. ``rule="every_rank_full"`` is the naive
layout (every rank writes its full state, sharded state gathered; the model on rank 0), kept as
the benchmark's point of comparison.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from scape_train.comm import Comm
from scape_train.optim.state import (FlatShard, MemoryShards, ShardSource, StateParts,
                                    assemble_range)

__all__ = ["AccountingComm", "FlatShard", "assemble_range", "MemoryShards", "MODEL_FILE", "REPLICATED_FILE",
           "ShardSource", "StateParts", "checkpoint_files", "file_bytes",
           "materialize_for_accounting", "rank_file", "shard_file", "state_bytes", "trainer_parts"]

MODEL_FILE = "model.pt"
REPLICATED_FILE = "replicated.pt"
RULES = ("owner", "every_rank_full")


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.pt"


# -- what each rank writes -------------------------------------------------------------------------

def trainer_parts(strategy: StateParts, *, data: dict, rng: dict, train: dict,
                  synchronous: bool) -> StateParts:
    """The trainer's checkpoint: the strategy's parts under ``optimizer``, plus the data cursor
    and RNG (per rank) and the train counters -- replicated under a synchronous strategy (every
    rank counts the same steps and tokens), per rank under a local-step one (each worker counts
    its own local steps)."""
    replicated: dict[str, Any] = {"optimizer": strategy.replicated}
    per_rank: dict[str, Any] = {"optimizer": strategy.per_rank, "data": data, "rng": rng}
    (replicated if synchronous else per_rank)["train"] = train
    return StateParts(replicated=replicated, per_rank=per_rank, sharded=strategy.sharded)


def checkpoint_files(rank: int, *, model_state: dict | None, parts: StateParts,
                     rule: str = "owner") -> dict[str, Any]:
    """The files rank ``rank`` writes and what each holds. The save writes exactly these.

    ``rule="owner"`` (the layout): rank 0 the model and the replicated part, each owner its shard,
    each rank its per-rank part. ``rule="every_rank_full"``: the layout before it, for accounting
    only -- every rank's file held the replicated part, the whole sharded state (gathered: here
    meta tensors of the full flat size) and its per-rank part.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    files: dict[str, Any] = {}
    if rank == 0 and model_state is not None:
        files[MODEL_FILE] = model_state
    if rule == "every_rank_full":
        full = None
        if parts.sharded is not None:
            s = parts.sharded
            full = {n: torch.empty(s.total, dtype=t.dtype, device="meta")
                    for n, t in s.tensors.items()}
        files[rank_file(rank)] = {"replicated": parts.replicated, "sharded": full,
                                  "per_rank": parts.per_rank}
        return files
    if rank == 0:
        files[REPLICATED_FILE] = parts.replicated
    if parts.sharded is not None and parts.sharded.numel:
        files[shard_file(rank)] = parts.sharded.to_dict()
    files[rank_file(rank)] = parts.per_rank
    return files


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, FlatShard):
        yield from _tensors(obj.tensors)


def state_bytes(obj: Any) -> int:
    """The tensor bytes ``torch.save(obj)`` writes: each distinct storage once, whole (a view
    costs its whole storage). Works on meta tensors. The file adds a small overhead (pickled
    structure, zip headers, alignment) that this does not count."""
    storages: dict[int, int] = {}
    for t in _tensors(obj):
        st = t.untyped_storage()
        storages[st._cdata] = st.nbytes()
    return sum(storages.values())


def file_bytes(files: dict[str, Any]) -> dict[str, int]:
    """:func:`state_bytes` of each file of :func:`checkpoint_files`."""
    return {name: state_bytes(obj) for name, obj in files.items()}


# -- accounting without a process group ----------------------------------------------------------

class AccountingComm(Comm):
    """ACCOUNTING ONLY: a ``Comm`` that claims ``rank`` of ``world`` with no process group, so a
    strategy can be built (on the meta device) as that rank would build it -- same partition,
    same owned range -- and its checkpoint pieces sized. Every collective raises: nothing built
    on it may train. Used by :func:`scape_train.checkpoint_layout` callers such as
    ``scripts/bench_checkpoint.py`` and the layout tests, never by the trainer."""

    def __init__(self, world: int, rank: int):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} not in [0, {world})")
        super().__init__(device=torch.device("cpu"))
        self.enabled, self.rank, self.world, self.backend = False, rank, world, "none"

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("AccountingComm is for checkpoint accounting only: it has no process "
                           "group and refuses every collective")

    all_reduce = reduce_scalars = all_gather = reduce_scatter = broadcast = exchange = _refuse
    broadcast_object = all_gather_object = all_ok = barrier = _refuse


def materialize_for_accounting(strategy) -> None:
    """ACCOUNTING ONLY, meta device only: the state a strategy creates lazily in its first step,
    allocated as empty meta tensors by the strategy itself
    (:meth:`~scape_train.optim.base.OptimizerStrategy.materialize_lazy_state`), so that
    ``checkpoint_state()`` has the shapes of a checkpoint taken mid-run. No value is computed and
    no collective issued."""
    strategy.materialize_lazy_state()
