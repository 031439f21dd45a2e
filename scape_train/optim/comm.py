"""Every collective the optimizers issue passes through here.

Bytes are counted per step and per *kind* (``grad``, ``payload``, ``mask``, ``params``,
``gossip``...) as the bytes one rank sends and receives under the ring algorithms (all-reduce /
all-gather / reduce-scatter; point-to-point exact), so that communication volume is a logged
figure, not an estimate. The ring figures are the per-rank average, floor-divided: when n does not
divide a tensor's size one rank's real share can differ from it by a few elements, and a backend
that picks another algorithm for a collective (NCCL may use a tree) moves other amounts. Time
spent blocked in ``wait()`` is counted too: that is the communication the step could not hide.

Without an initialized process group (or with a world of one) every operation is a local no-op
with the correct result, so the same optimizer code runs as one process.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def ring_all_reduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``."""
    return 0 if world <= 1 else (2 * (world - 1) * nbytes) // world


def ring_all_gather_bytes(shard_nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-gather of per-rank ``shard_nbytes``."""
    return 0 if world <= 1 else (world - 1) * shard_nbytes


def ring_reduce_scatter_bytes(total_nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring reduce-scatter of a ``total_nbytes`` input."""
    return 0 if world <= 1 else ((world - 1) * total_nbytes) // world


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class KindStats:
    sent_bytes: int = 0
    recv_bytes: int = 0
    calls: int = 0
    wait_s: float = 0.0


class Handle:
    """An in-flight collective. ``wait()`` blocks, runs any finishing op, and counts the wait."""

    def __init__(self, comm: "Comm", kind: str, work=None, finish=None):
        self._comm, self._kind, self._work, self._finish = comm, kind, work, finish
        self.done = work is None and finish is None

    @property
    def work(self):
        """The backend's work object of an async collective (None when nothing is in flight);
        ``work.get_future()`` gives the torch future DDP comm hooks return."""
        return self._work

    def wait(self) -> None:
        if self.done:
            return
        start = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        self._comm.stats[self._kind].wait_s += time.perf_counter() - start
        self.done = True


@dataclass
class Comm:
    """Counted collectives over one process group (``None`` = the default group)."""

    group: object | None = None
    stats: dict = field(default_factory=lambda: defaultdict(KindStats))

    def __post_init__(self):
        self.enabled = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(self.group) if self.enabled else 0
        self.world = dist.get_world_size(self.group) if self.enabled else 1
        self.backend = dist.get_backend(self.group) if self.enabled else "none"

    # -- bookkeeping -----------------------------------------------------------------------
    def count(self, kind: str, sent: int, recv: int) -> None:
        """Record bytes a collective issued outside this class sent (e.g. a library hook)."""
        s = self.stats[kind]
        s.sent_bytes += sent
        s.recv_bytes += recv
        s.calls += 1

    def _run(self, kind: str, work, async_op: bool, finish=None, started: float | None = None
             ) -> Handle:
        """``started``: when the (blocking) collective was issued, so its time counts as wait."""
        handle = Handle(self, kind, work if async_op else None, finish)
        if not async_op:
            start = time.perf_counter() if started is None else started
            if finish is not None:
                finish()
            self.stats[kind].wait_s += time.perf_counter() - start
            handle.done = True
        return handle

    def pop_stats(self) -> dict[str, float]:
        """Flat metrics for the step just finished (``comm/<kind>_sent_bytes`` ...); resets."""
        out: dict[str, float] = {}
        total_sent = total_wait = 0.0
        for kind, s in sorted(self.stats.items()):
            out[f"comm/{kind}_sent_bytes"] = s.sent_bytes
            out[f"comm/{kind}_recv_bytes"] = s.recv_bytes
            out[f"comm/{kind}_wait_s"] = s.wait_s
            total_sent += s.sent_bytes
            total_wait += s.wait_s
        out["comm/sent_bytes"] = total_sent
        out["comm/wait_s"] = total_wait
        self.stats = defaultdict(KindStats)
        return out

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, kind: str, average: bool = True,
                   async_op: bool = False) -> Handle:
        """In-place sum (or mean) over ranks."""
        if self.world == 1:
            return Handle(self, kind)
        n = ring_all_reduce_bytes(_nbytes(tensor), self.world)
        self.count(kind, n, n)
        started = time.perf_counter()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        # gloo has no ReduceOp.AVG: sum, then divide once the data has arrived.
        finish = (lambda: tensor.div_(self.world)) if average else None
        return self._run(kind, work, async_op, finish, started)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, kind: str,
                   async_op: bool = False) -> Handle:
        """``output`` (world * shard.numel()) receives every rank's equal-sized ``shard``."""
        if self.world == 1:
            output.copy_(shard.reshape(output.shape))
            return Handle(self, kind)
        n = ring_all_gather_bytes(_nbytes(shard), self.world)
        self.count(kind, n, n)
        started = time.perf_counter()
        work = dist.all_gather_into_tensor(output, shard, group=self.group, async_op=async_op)
        return self._run(kind, work, async_op, started=started)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, kind: str,
                       average: bool = True, async_op: bool = False) -> Handle:
        """``output`` receives this rank's equal chunk of the sum (mean) of ``input``."""
        if self.world == 1:
            output.copy_(input.reshape(output.shape))
            return Handle(self, kind)
        n = ring_reduce_scatter_bytes(_nbytes(input), self.world)
        self.count(kind, n, n)
        started = time.perf_counter()
        work = dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=self.group,
                                          async_op=async_op)
        finish = (lambda: output.div_(self.world)) if average else None
        return self._run(kind, work, async_op, finish, started)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, kind: str) -> Handle:
        if self.world == 1:
            return Handle(self, kind)
        n = _nbytes(tensor)
        self.count(kind, n if self.rank == src else 0, 0 if self.rank == src else n)
        dist.broadcast(tensor, src=src, group=self.group)
        return Handle(self, kind)

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                 *, kind: str, async_op: bool = False) -> Handle:
        """Point-to-point: send each ``(tensor, peer)`` and receive into each ``(tensor, peer)``."""
        ops = [dist.P2POp(dist.isend, t, self._global(p), self.group) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group) for t, p in recvs]
        if not ops:
            return Handle(self, kind)
        self.count(kind, sum(_nbytes(t) for t, _ in sends), sum(_nbytes(t) for t, _ in recvs))
        works = dist.batch_isend_irecv(ops)

        class _All:
            def wait(self_inner):
                for w in works:
                    w.wait()

        return self._run(kind, _All(), async_op, None if async_op else (lambda: _All().wait()))

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
