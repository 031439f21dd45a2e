"""Every collective of the package passes through here: the optimizers', the trainer's scalars
and flags, checkpoint agreement, evaluation.

Bytes are counted per step and per *kind* (``grad``, ``payload``, ``mask``, ``params``,
``gossip``...) as the bytes one rank sends and receives under the ring algorithms (all-reduce /
all-gather / reduce-scatter; all-to-all and point-to-point exact), so that communication volume is a logged
figure, not an estimate. The ring figures are the per-rank average, floor-divided: when n does not
divide a tensor's size one rank's real share can differ from it by a few elements, and a backend
that picks another algorithm for a collective (NCCL may use a tree) moves other amounts. Time
spent blocked in ``wait()`` is counted too: that is the communication the step could not hide.

Without an initialized process group (or with a world of one) every operation is a local no-op
with the correct result, so the same optimizer code runs as one process.

NCCL's rules hold here for every backend, so that code tested on gloo runs on NCCL:
- every tensor handed to a collective lives on the group's device (``Comm.device``: the current
  CUDA device under NCCL, the CPU under gloo), scalars and control flags included
  (:meth:`Comm.reduce_scalars`), and a tensor elsewhere is refused before anything is sent;
- nothing here reads a device value on the host: a result is read by the caller, once, when it
  needs it (``reduce_scalars`` returns a device tensor);
- waiting time is measured on the device under CUDA (events around the stream wait, read only when
  the stats are popped, at a log step), and on the host clock under gloo, whose waits block it.
:func:`enforce_comm_only` makes any collective issued from this package outside this module fail
(the test suite turns it on in every process).
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

STRICT_ENV = "SCAPE_STRICT_COMM"
# The public collectives of torch.distributed that package code might call directly.
_GUARDED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
            "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
            "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
            "gather_object", "scatter_object_list", "gather", "scatter", "reduce",
            "all_to_all", "all_to_all_single", "batch_isend_irecv", "send", "recv", "isend",
            "irecv")
_PACKAGE_DIR = str(Path(__file__).resolve().parent)   # .../scape_train
_THIS_FILE = str(Path(__file__).resolve())


class CollectiveOutsideCommError(RuntimeError):
    pass


def _caller_in_package() -> str | None:
    """Where the collective was called from, when that is this package but not this module.

    Only the immediate caller counts: torch-internal code (DDP's reducer, a library comm hook
    such as PowerSGD's) may issue collectives of its own; package code may not."""
    frame = sys._getframe(2)     # 0: here, 1: guarded(), 2: its caller
    path = frame.f_code.co_filename
    if path != _THIS_FILE and path.startswith(_PACKAGE_DIR):
        return f"{path}:{frame.f_lineno}"
    return None


def enforce_comm_only() -> None:
    """Make every ``torch.distributed`` collective issued by this package outside ``Comm`` raise.

    Idempotent. Collectives that torch itself issues on behalf of library code (DDP's reducer,
    a library comm hook) are left alone: their bytes are counted where the hook is installed.
    """
    for name in _GUARDED:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_scape_guarded", False):
            continue

        def guarded(*args, __fn=fn, __name=name, **kwargs):
            where = _caller_in_package()
            if where is not None:
                raise CollectiveOutsideCommError(
                    f"torch.distributed.{__name} called from {where}, outside comm.py: every "
                    "collective goes through Comm (device tensors, counted bytes)")
            return __fn(*args, **kwargs)

        functools.update_wrapper(guarded, fn)
        guarded._scape_guarded = True
        setattr(dist, name, guarded)


def enforce_comm_only_from_env() -> None:
    if os.environ.get(STRICT_ENV, "") == "1":
        enforce_comm_only()


def ring_all_reduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``."""
    return 0 if world <= 1 else (2 * (world - 1) * nbytes) // world


def ring_all_gather_bytes(shard_nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-gather of per-rank ``shard_nbytes``."""
    return 0 if world <= 1 else (world - 1) * shard_nbytes


def ring_reduce_scatter_bytes(total_nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring reduce-scatter of a ``total_nbytes`` input."""
    return 0 if world <= 1 else ((world - 1) * total_nbytes) // world


def all_to_all_bytes(total_nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in an all-to-all of a ``total_nbytes`` input split into
    ``world`` equal chunks: every chunk but its own goes to one peer (exact, point-to-point)."""
    return 0 if world <= 1 else ((world - 1) * total_nbytes) // world


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class KindStats:
    sent_bytes: int = 0
    recv_bytes: int = 0
    calls: int = 0
    wait_s: float = 0.0
    # CUDA: (start, end) events around each wait, resolved into wait_s when the stats are popped
    events: list = field(default_factory=list)


class _WaitTimer:
    """Times a wait: CUDA events on the current stream under CUDA (the stream stalls there, the
    host does not), the host clock otherwise."""

    def __init__(self, stats: KindStats, device: torch.device):
        self.stats, self.cuda = stats, device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats.events.append((self.start, end))
        else:
            self.stats.wait_s += time.perf_counter() - self.start


class Handle:
    """An in-flight collective. ``wait()`` makes the caller's stream (gloo: the host) wait for
    it, runs any finishing op, and counts the wait."""

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
        timer = _WaitTimer(self._comm.stats[self._kind], self._comm.device)
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        timer.stop()
        self.done = True


# One phase of a point-to-point exchange: (sends, recvs), each a list of (tensor, peer).
Phase = tuple[list[tuple[torch.Tensor, int]], list[tuple[torch.Tensor, int]]]


class _Works(list):
    """Backend work objects waited for together."""

    def wait(self) -> None:
        while self:
            work = self.pop(0)
            if work is not None:
                work.wait()


class _PhasesInThread:
    """A phased exchange run by a daemon thread; ``wait()`` joins it and raises what it raised."""

    def __init__(self, run):
        self._error: BaseException | None = None

        def target():
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's wait()
                self._error = e

        self._thread = threading.Thread(target=target, name="scape-exchange", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def default_device(backend: str) -> torch.device:
    """The device a backend's collectives take tensors on: NCCL the current CUDA device."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _data_bytes(stats: dict) -> int:
    return sum(s.sent_bytes for kind, s in stats.items() if kind != "control")


@dataclass
class Comm:
    """Counted collectives over one process group (``None`` = the default group).

    ``device``: where this group's tensors live (default: the backend's, see
    :func:`default_device`); a collective on a tensor elsewhere is refused.
    """

    group: object | None = None
    device: torch.device | None = None
    stats: dict = field(default_factory=lambda: defaultdict(KindStats))
    # data bytes this rank sent before the current window (a resumed run starts from its
    # checkpoint's figure)
    sent_before: int = 0
    # whether :meth:`all_to_all` runs on this group (torchft's replica groups: no)
    offers_all_to_all: ClassVar[bool] = True

    def __post_init__(self):
        self.enabled = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(self.group) if self.enabled else 0
        self.world = dist.get_world_size(self.group) if self.enabled else 1
        self.backend = dist.get_backend(self.group) if self.enabled else "none"
        if self.device is None:
            self.device = default_device(self.backend)
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    # -- bookkeeping -----------------------------------------------------------------------
    def count(self, kind: str, sent: int, recv: int) -> None:
        """Record bytes a collective issued outside this class sent (e.g. a library hook)."""
        s = self.stats[kind]
        s.sent_bytes += sent
        s.recv_bytes += recv
        s.calls += 1

    def _check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self.device:
                raise ValueError(
                    f"collective on a tensor on {t.device}, but this process group's tensors live "
                    f"on {self.device} (backend {self.backend}); NCCL refuses host tensors: build "
                    "it on Comm.device")

    def _run(self, kind: str, work, async_op: bool, finish=None,
             timer: _WaitTimer | None = None) -> Handle:
        """``timer``: started before a blocking collective was issued (:meth:`_start_timer`)."""
        handle = Handle(self, kind, work if async_op else None, finish)
        if not async_op:
            if finish is not None:
                finish()
            timer.stop()
            handle.done = True
        return handle

    def _start_timer(self, kind: str, async_op: bool) -> _WaitTimer | None:
        """Started before a blocking collective is issued: all of a blocking call is wait. NCCL
        queues the stream's wait inside the call (an event recorded after it would time
        nothing), gloo blocks the host there. An async collective's wait is timed in
        ``Handle.wait``."""
        return None if async_op else _WaitTimer(self.stats[kind], self.device)

    def total_sent_bytes(self) -> int:
        """Data bytes this rank sent over the whole run so far, the current window included:
        every kind but ``control`` (the loss agreement, stop and checkpoint flags, whose count
        depends on how often a run was stopped and resumed, not on the optimizer)."""
        return self.sent_before + _data_bytes(self.stats)

    def restore_total(self, sent_bytes: int) -> None:
        """The run's total as a checkpoint saved it. Anything this process sent before loading
        it stays in this window's per-kind figures but not in the total, so a run's total does
        not depend on how often it was resumed."""
        self.sent_before = sent_bytes - _data_bytes(self.stats)

    def pop_stats(self) -> dict[str, float]:
        """Flat metrics since the last pop (``comm/<kind>_sent_bytes`` ...); resets.

        Under CUDA this reads the wait events: one synchronization, at a log step."""
        out: dict[str, float] = {}
        total_sent = total_wait = 0.0
        for kind, s in sorted(self.stats.items()):
            for start, end in s.events:
                end.synchronize()
                s.wait_s += start.elapsed_time(end) / 1e3
            if s.calls:   # a kind only waited for here (issued in an earlier window) sent nothing now
                out[f"comm/{kind}_sent_bytes"] = s.sent_bytes
                out[f"comm/{kind}_recv_bytes"] = s.recv_bytes
            out[f"comm/{kind}_wait_s"] = s.wait_s
            total_sent += s.sent_bytes
            total_wait += s.wait_s
        out["comm/sent_bytes"] = total_sent
        self.sent_before += _data_bytes(self.stats)
        out["comm/wait_s"] = total_wait
        self.stats = defaultdict(KindStats)
        return out

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, kind: str, average: bool = True,
                   op: str = "sum", async_op: bool = False) -> Handle:
        """In-place sum (or mean; or ``op="min"|"max"``) over ranks."""
        if self.world == 1:
            return Handle(self, kind)
        self._check(tensor)
        n = ring_all_reduce_bytes(_nbytes(tensor), self.world)
        self.count(kind, n, n)
        timer = self._start_timer(kind, async_op)
        reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                     "max": dist.ReduceOp.MAX}[op]
        work = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=async_op)
        # gloo has no ReduceOp.AVG: sum, then divide once the data has arrived.
        finish = (lambda: tensor.div_(self.world)) if average and op == "sum" else None
        return self._run(kind, work, async_op, finish, timer)

    def scalars(self, values) -> torch.Tensor:
        """Numbers and 0-d device tensors as one float64 tensor on ``device``, without reading
        any of them on the host."""
        # a number is filled on the device: a tensor made from it would be copied, blocking
        return torch.cat([v.reshape(1).to(torch.float64) if isinstance(v, torch.Tensor)
                          else torch.full((1,), float(v), dtype=torch.float64, device=self.device)
                          for v in values])

    def reduce_scalars(self, values, *, op: str = "sum", kind: str = "control") -> torch.Tensor:
        """Sum (``op="min"|"max"``) a few scalars over ranks: a float64 tensor on ``device``.

        The caller reads the result (``.tolist()``) once, when it must.
        """
        t = self.scalars(values)
        self.all_reduce(t, kind=kind, average=False, op=op)
        return t

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, kind: str,
                   async_op: bool = False) -> Handle:
        """``output`` (world * shard.numel()) receives every rank's equal-sized ``shard``."""
        if self.world == 1:
            output.copy_(shard.reshape(output.shape))
            return Handle(self, kind)
        self._check(output, shard)
        n = ring_all_gather_bytes(_nbytes(shard), self.world)
        self.count(kind, n, n)
        timer = self._start_timer(kind, async_op)
        work = dist.all_gather_single(output, shard, group=self.group, async_op=async_op)
        return self._run(kind, work, async_op, timer=timer)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, kind: str,
                       average: bool = True, async_op: bool = False) -> Handle:
        """``output`` receives this rank's equal chunk of the sum (mean) of ``input``."""
        if self.world == 1:
            output.copy_(input.reshape(output.shape))
            return Handle(self, kind)
        self._check(output, input)
        n = ring_reduce_scatter_bytes(_nbytes(input), self.world)
        self.count(kind, n, n)
        timer = self._start_timer(kind, async_op)
        work = dist.reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=self.group,
                                          async_op=async_op)
        finish = (lambda: output.div_(self.world)) if average else None
        return self._run(kind, work, async_op, finish, timer)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, kind: str,
                   async_op: bool = False) -> Handle:
        """Equal splits: chunk ``j`` of ``input`` goes to rank ``j``; chunk ``i`` of ``output``
        comes from rank ``i`` (both ``world`` equal chunks along dim 0). No reduction, so any
        dtype the backend moves works (SCAPE sends uint8 bytes)."""
        if self.world == 1:
            output.copy_(input.reshape(output.shape))
            return Handle(self, kind)
        self._check(output, input)
        if input.numel() % self.world or output.numel() != input.numel():
            raise ValueError(f"all_to_all needs equal chunks: input {input.numel()} elements, "
                             f"output {output.numel()}, world {self.world}")
        n = all_to_all_bytes(_nbytes(input), self.world)
        self.count(kind, n, n)
        timer = self._start_timer(kind, async_op)
        work = dist.all_to_all_single(output, input, group=self.group, async_op=async_op)
        return self._run(kind, work, async_op, timer=timer)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, kind: str) -> Handle:
        if self.world == 1:
            return Handle(self, kind)
        self._check(tensor)
        n = _nbytes(tensor)
        self.count(kind, n if self.rank == src else 0, 0 if self.rank == src else n)
        timer = self._start_timer(kind, async_op=False)
        dist.broadcast(tensor, src=self._global(src), group=self.group)
        return self._run(kind, None, False, timer=timer)

    def exchange(self, phases: list[Phase], *, kind: str, async_op: bool = False) -> Handle:
        """Point-to-point in phases: each phase ``(sends, recvs)`` sends each ``(tensor, peer)``
        and receives into each ``(tensor, peer)``. On gloo a phase starts when the one before it
        has finished (async: a thread issues them behind the caller), so a phase in which each
        worker sends to one peer puts one flow on each TCP link: two at once out of one slow link
        took about twice as long as the same bytes sent one after the other (docs/gasloc.md,
        "The exchange in phases"). On NCCL every phase goes out in one batch, which NCCL
        schedules itself (not measured)."""
        phases = self._checked(phases)
        if not phases:
            return Handle(self, kind)
        self._count_phases(kind, phases)
        timer = self._start_timer(kind, async_op)
        if self.device.type != "cpu":
            c10d = dist.distributed_c10d    # P2POp accepts only c10d's own isend/irecv objects
            work = _Works(dist.batch_isend_irecv(
                [dist.P2POp(c10d.isend, t, self._global(p), self.group) for s, _ in phases
                 for t, p in s]
                + [dist.P2POp(c10d.irecv, t, self._global(p), self.group) for _, r in phases
                   for t, p in r]))
        elif async_op:
            work = _PhasesInThread(lambda: self._gloo_phases(phases))
        else:
            work = self._gloo_phases(phases)
        return self._run(kind, work, async_op, None if async_op else work.wait, timer)

    def _checked(self, phases: list[Phase]) -> list[Phase]:
        """The phases with anything to do, their tensors checked."""
        phases = [(list(s), list(r)) for s, r in phases if s or r]
        self._check(*(t for s, r in phases for t, _ in s + r))
        return phases

    def _count_phases(self, kind: str, phases: list[Phase]) -> None:
        self.count(kind, sum(_nbytes(t) for s, _ in phases for t, _ in s),
                   sum(_nbytes(t) for _, r in phases for t, _ in r))

    def _gloo_phases(self, phases: list[Phase]) -> "_Works":
        """Each phase issued, then waited for, in turn. Op by op, not through batch_isend_irecv:
        its coalescing state is the group's, which a collective issued meanwhile from the
        trainer's thread would share."""
        works = _Works()
        for sends, recvs in phases:
            works.extend(dist.isend(t, self._global(p), self.group) for t, p in sends)
            works.extend(dist.irecv(t, self._global(p), self.group) for t, p in recvs)
            works.wait()
        return works

    def commit(self) -> bool:
        """The outer round's vote, after its exchange: may this worker apply the round? A static
        group has nothing to vote on (a failed collective raises), so yes; :class:`ReplicaComm`
        asks the torchft manager, where a round commits only if every participant votes for it."""
        return True

    # -- control: objects and barriers (start-up, checkpoints, evaluation) -----------------
    def broadcast_object(self, obj, src: int = 0, *, kind: str = "control"):
        """``src``'s picklable ``obj`` on every rank (staged through ``device`` tensors)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group,
                                   device=self.device)
        n = len(pickle.dumps(box[0]))
        self.count(kind, n if self.rank == src else 0, 0 if self.rank == src else n)
        return box[0]

    def all_gather_object(self, obj, *, kind: str = "control") -> list:
        """Every rank's picklable ``obj``, in rank order."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        n = len(pickle.dumps(obj))
        self.count(kind, n * (self.world - 1), sum(len(pickle.dumps(o)) for i, o in enumerate(out)
                                                   if i != self.rank))
        return out

    def all_ok(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (one device-tensor MIN all-reduce, read once)."""
        if self.world == 1:
            return ok
        return bool(self.reduce_scalars([1.0 if ok else 0.0], op="min").item())

    def barrier(self) -> None:
        if self.world > 1:
            if self.device.type == "cuda":
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


class ReplicaComm(Comm):
    """Counted collectives across torchft replica groups (``scape_train/elastic``): one worker
    per replica group, joined by the managed process group of a ``torchft.Manager`` whose
    members change between rounds. ``rank`` and ``world`` are this worker's place in the current
    quorum (1 of 1 before the first). A collective that fails (a peer killed, or frozen past the
    manager's timeout) does not raise: the manager records the error and :meth:`commit` then
    returns False on every participant, so nobody applies the round. Only what the rounds use
    is offered: the all-reduce (DiLoCo, complete-graph GASLoC, data parallelism), the
    point-to-point exchange (GASLoC's gossip) and the all-gather (SparseLoCo, SCAPE's masks);
    the rest raises. Each completes inside its call: a round votes right after its exchanges,
    so nothing may still be in flight then. An ``async_op`` request gets a completed handle
    (SCAPE's step asks for its payload and its next mask asynchronously; here they block)."""

    def __init__(self, manager, pg, device: torch.device | str = "cpu"):
        self.manager, self.pg = manager, pg
        self.group, self.device = None, torch.device(device)
        self.stats, self.sent_before = defaultdict(KindStats), 0
        self.enabled, self.backend = True, "torchft"
        self.quorum_started = False
        self._place = (0, 1)     # (rank, world) in the last quorum: see :meth:`took_quorum`
        self.last_vote: bool | None = None
        self.last_error: Exception | None = None
        self.kill_at_vote: int | None = None    # fault injection (tests): see elastic/replica.py
        self.freeze_at_exchange: int | None = None

    def _fault_at_exchange(self) -> None:
        if self.freeze_at_exchange == self.manager.current_step():
            os.kill(os.getpid(), signal.SIGSTOP)

    def took_quorum(self) -> None:
        """This worker's place in the quorum just formed, read once from the manager: its
        getters wait for the quorum, and a healing peer's state is taken inside the quorum
        (where asking them again would wait on itself)."""
        self.quorum_started = True
        self._place = (self.manager.participating_rank() or 0,
                       max(self.manager.num_participants(), 1))

    @property
    def rank(self) -> int:
        return self._place[0]

    @property
    def world(self) -> int:
        return self._place[1]

    def all_reduce(self, tensor: torch.Tensor, *, kind: str, average: bool = True,
                   op: str = "sum", async_op: bool = False) -> Handle:
        if op != "sum":
            raise NotImplementedError(f"across replica groups only the sum/mean all-reduce is "
                                      f"offered, got op={op!r}")
        from torch.distributed import ReduceOp

        self._check(tensor)
        self._fault_at_exchange()
        n = ring_all_reduce_bytes(_nbytes(tensor), self.world)
        self.count(kind, n, n)
        timer = self._start_timer(kind, async_op=False)
        # The manager divides by the participants itself (AVG); a failure is recorded, not raised.
        self.manager.allreduce(tensor, reduce_op=ReduceOp.AVG if average else ReduceOp.SUM).wait()
        timer.stop()
        return Handle(self, kind)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, kind: str,
                   async_op: bool = False) -> Handle:
        """The quorum's equal-sized shards into ``output`` in quorum order. A failed gather (or
        a round already failed) leaves ``output`` zeroed, not partly written: the caller may
        decode it before its vote, which then fails."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        self._check(output, shard)
        if self.manager.errored():
            output.zero_()
            return Handle(self, kind)
        if self.world == 1:
            output.copy_(shard.reshape(output.shape))
            return Handle(self, kind)
        self._fault_at_exchange()
        n = ring_all_gather_bytes(_nbytes(shard), self.world)
        self.count(kind, n, n)
        timer = self._start_timer(kind, async_op=False)
        try:
            slots = list(output.view(self.world, -1).unbind(0))
            self.pg.allgather([slots], [shard.reshape(-1)], AllgatherOptions()).wait()
        except Exception as exc:  # noqa: BLE001 - a lost peer fails the round's vote, not the job
            output.zero_()
            self.manager.report_error(exc)
        timer.stop()
        return Handle(self, kind)

    def exchange(self, phases: list[Phase], *, kind: str, async_op: bool = False) -> Handle:
        phases = self._checked(phases)
        if self.manager.errored() or not phases:
            return Handle(self, kind)
        self._fault_at_exchange()
        self._count_phases(kind, phases)
        timer = self._start_timer(kind, async_op=False)
        try:
            for sends, recvs in phases:       # one after another, as Comm.exchange
                works = [self.pg.send([t], peer, 0) for t, peer in sends]
                works += [self.pg.recv([t], peer, 0) for t, peer in recvs]
                for w in works:
                    w.wait()
        except Exception as exc:  # noqa: BLE001 - a lost peer fails the round's vote, not the job
            self.manager.report_error(exc)
        timer.stop()
        return Handle(self, kind)

    def commit(self) -> bool:
        if self.kill_at_vote == self.manager.current_step():
            os.kill(os.getpid(), signal.SIGKILL)
        self.last_error = self.manager.errored()
        self.last_vote = bool(self.manager.should_commit())
        return self.last_vote

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError("ReplicaComm carries the outer rounds' all-reduce, exchange "
                                  "and all-gather only; start-up, checkpoints and evaluation use "
                                  "the worker's own process group")

    offers_all_to_all = False
    reduce_scatter = all_to_all = broadcast = _refuse
    broadcast_object = all_gather_object = all_ok = barrier = _refuse
