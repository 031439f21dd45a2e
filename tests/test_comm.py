"""Comm: every collective gives the right result and counts the ring-algorithm bytes."""

from __future__ import annotations

import pytest
import torch

from scape_train.comm import (Comm, all_to_all_bytes, ring_all_gather_bytes,
                                    ring_all_reduce_bytes, ring_reduce_scatter_bytes)

from ._dist import run_distributed


def _comm_worker(rank, world):
    comm = Comm()
    out = {}
    x = torch.full((6,), float(rank + 1))
    comm.all_reduce(x, kind="payload")                       # mean
    out["mean"] = x
    y = torch.full((5,), float(rank + 1))
    h = comm.all_reduce(y, kind="payload", average=False, async_op=True)
    h.wait()
    h.wait()                                                 # idempotent
    out["sum"] = y
    shard = torch.arange(3, dtype=torch.int64) + 10 * rank
    gathered = torch.empty(3 * world, dtype=torch.int64)
    comm.all_gather(gathered, shard, kind="mask", async_op=True).wait()
    out["gathered"] = gathered
    inp = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
    rs = torch.empty(2)
    comm.reduce_scatter(rs, inp, kind="params")
    out["rs"] = rs
    b = torch.full((4,), float(rank))
    comm.broadcast(b, src=1, kind="params")
    out["bcast"] = b
    send = torch.full((2,), float(rank))
    recv = torch.empty(2)
    comm.exchange([([(send, (rank + 1) % world)], [(recv, (rank - 1) % world)])], kind="gossip")
    out["recv"] = recv
    a2a_in = torch.arange(2 * world, dtype=torch.int64) + 100 * rank
    a2a_out = torch.empty_like(a2a_in)
    comm.all_to_all(a2a_out, a2a_in, kind="a2a")
    out["a2a"] = a2a_out
    out["total_before_pop"] = comm.total_sent_bytes()
    out["stats"] = comm.pop_stats()
    out["after_pop"] = comm.pop_stats()
    comm.all_reduce(torch.ones(2), kind="payload")
    out["total_after"] = comm.total_sent_bytes()
    return out


def _phased_exchange_worker(rank, world, async_op):
    import torch.distributed as dist

    import scape_train.comm as comm_mod

    events: list[str] = []
    isend, irecv, works_wait = dist.isend, dist.irecv, comm_mod._Works.wait

    def logged_isend(t, dst, *a, **k):
        events.append(f"send {dst}")
        return isend(t, dst, *a, **k)

    def logged_irecv(t, src, *a, **k):
        events.append(f"recv {src}")
        return irecv(t, src, *a, **k)

    def logged_wait(self):
        if self:
            events.append("wait")
        works_wait(self)

    dist.isend, dist.irecv, comm_mod._Works.wait = logged_isend, logged_irecv, logged_wait
    comm = Comm()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    fwd, bwd = torch.full((3,), float(rank)), torch.full((3,), 10.0 + rank)
    from_prev, from_next = torch.empty(3), torch.empty(3)
    handle = comm.exchange([([(fwd, nxt)], [(from_prev, prev)]), ([(bwd, prev)], [(from_next, nxt)])],
                           kind="gossip", async_op=async_op)
    total = torch.ones(2)
    comm.all_reduce(total, kind="val", average=False)   # the trainer's thread, meanwhile
    handle.wait()
    return {"events": events, "from_prev": from_prev, "from_next": from_next, "total": total,
            "stats": comm.pop_stats()}


@pytest.mark.parametrize("async_op", [False, True])
def test_exchange_runs_its_phases_one_after_another(async_op):
    """A phase's sends are issued only once the phase before it has finished (blocking, and
    async on gloo, where a thread runs the phases while the caller issues other collectives)."""
    world = 3
    res = run_distributed(_phased_exchange_worker, world, (async_op,))
    for rank, r in enumerate(res):
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        assert r["events"] == [f"send {nxt}", f"recv {prev}", "wait", f"send {prev}",
                               f"recv {nxt}", "wait"]
        assert torch.equal(r["from_prev"], torch.full((3,), float(prev)))
        assert torch.equal(r["from_next"], torch.full((3,), 10.0 + nxt))
        assert torch.equal(r["total"], torch.full((2,), 3.0))
        assert r["stats"]["comm/gossip_sent_bytes"] == r["stats"]["comm/gossip_recv_bytes"] == 24


def test_collectives_and_byte_counts_three_ranks():
    world = 3
    res = run_distributed(_comm_worker, world)
    for rank, r in enumerate(res):
        assert torch.equal(r["mean"], torch.full((6,), 2.0))
        assert torch.equal(r["sum"], torch.full((5,), 6.0))
        assert r["gathered"].tolist() == [0, 1, 2, 10, 11, 12, 20, 21, 22]
        full = torch.arange(2 * world, dtype=torch.float32) * 2.0   # mean of (rank+1) = 2
        assert torch.equal(r["rs"], full[2 * rank: 2 * rank + 2])
        assert torch.equal(r["bcast"], torch.full((4,), 1.0))
        assert torch.equal(r["recv"], torch.full((2,), float((rank - 1) % world)))
        st = r["stats"]
        assert st["comm/payload_sent_bytes"] == (ring_all_reduce_bytes(24, world)
                                                 + ring_all_reduce_bytes(20, world))
        assert st["comm/mask_sent_bytes"] == ring_all_gather_bytes(24, world)
        params = ring_reduce_scatter_bytes(4 * 2 * world, world) + (16 if rank == 1 else 0)
        assert st["comm/params_sent_bytes"] == params
        assert st["comm/gossip_sent_bytes"] == 8 and st["comm/gossip_recv_bytes"] == 8
        # all-to-all: chunk i of the output is rank i's chunk ``rank``; own chunk not sent
        assert r["a2a"].tolist() == [100 * i + 2 * rank + j for i in range(world) for j in (0, 1)]
        assert st["comm/a2a_sent_bytes"] == all_to_all_bytes(16 * world, world) == 16 * (world - 1)
        assert st["comm/sent_bytes"] == sum(v for k, v in st.items()
                                            if k.endswith("_sent_bytes") and k != "comm/sent_bytes")
        assert r["after_pop"]["comm/sent_bytes"] == 0
        # the run's total keeps what each pop resets
        data = st["comm/sent_bytes"] - st.get("comm/control_sent_bytes", 0)
        assert r["total_before_pop"] == data
        assert r["total_after"] == data + ring_all_reduce_bytes(8, world)


def test_single_process_is_a_correct_no_op():
    comm = Comm()
    assert comm.world == 1 and comm.rank == 0
    x = torch.arange(4.0)
    comm.all_reduce(x, kind="payload")
    assert torch.equal(x, torch.arange(4.0))
    out = torch.empty(4)
    comm.all_gather(out, torch.arange(4.0), kind="mask")
    assert torch.equal(out, torch.arange(4.0))
    assert comm.pop_stats()["comm/sent_bytes"] == 0


@pytest.mark.parametrize("nbytes,world", [(1000, 2), (1000, 4), (7, 3)])
def test_ring_formulas(nbytes, world):
    assert ring_all_reduce_bytes(nbytes, world) == 2 * (world - 1) * nbytes // world
    assert ring_all_gather_bytes(nbytes, world) == (world - 1) * nbytes
    assert ring_reduce_scatter_bytes(nbytes, world) == (world - 1) * nbytes // world
    assert ring_all_reduce_bytes(nbytes, 1) == 0


class _StreamClock:
    """A CUDA stream as the events see it: a blocking NCCL collective returns at once on the
    host and queues the stream's wait (here: 1 s of stream time) inside the call."""
    now = 0.0


class _StreamEvent:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = _StreamClock.now

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                        "broadcast", "exchange"])
def test_blocking_collectives_count_their_wait_on_cuda(collective, monkeypatch):
    """Fake events on a fake CUDA comm: the stream's wait queued inside each blocking call is
    counted in ``comm/wait_s`` (the start event is recorded before the call)."""
    import torch.distributed as dist

    def queued_wait(*args, **kwargs):
        _StreamClock.now += 1.0
        return [] if args and isinstance(args[0], list) else None   # batch_isend_irecv: works

    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single",
                 "broadcast", "batch_isend_irecv"):
        monkeypatch.setattr(dist, name, queued_wait, raising=False)
    monkeypatch.setattr(dist, "P2POp", lambda *a: a)
    monkeypatch.setattr(torch.cuda, "Event", _StreamEvent)
    monkeypatch.setattr(Comm, "_check", lambda self, *t: None)   # host tensors stand in
    comm = Comm()
    comm.world, comm.device = 2, torch.device("cuda", 0)
    x = torch.zeros(4)
    {"all_reduce": lambda: comm.all_reduce(x, kind="k"),
     "all_gather": lambda: comm.all_gather(torch.zeros(8), x, kind="k"),
     "reduce_scatter": lambda: comm.reduce_scatter(torch.zeros(2), x, kind="k"),
     "all_to_all": lambda: comm.all_to_all(torch.zeros(4), x, kind="k"),
     "broadcast": lambda: comm.broadcast(x, kind="k"),
     "exchange": lambda: comm.exchange([([(x, 1)], [(torch.zeros(4), 1)])], kind="k")}[collective]()
    assert comm.pop_stats()["comm/wait_s"] == pytest.approx(1.0)
