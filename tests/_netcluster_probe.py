"""Rank programs that tests/test_netcluster.py runs inside netcluster namespaces.

    python tests/_netcluster_probe.py allreduce        # 2+ ranks: gloo all-reduce via the env vars
    python tests/_netcluster_probe.py tcp NBYTES       # rank 1 sends NBYTES to rank 0 over TCP

Each prints one result line on stdout that the test parses from the logs.
"""

from __future__ import annotations

import os
import socket
import sys
import time


def allreduce() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// from MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((4096,), float(rank + 1))
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert torch.all(t == expected), (t[:4], expected)
    dist.destroy_process_group()
    print(f"ALLREDUCE_OK rank={rank} world={world} value={t[0].item():g} "
          f"addr={os.environ['NETCLUSTER_ADDR']}", flush=True)


def tcp(nbytes: int) -> None:
    """Rank 0 receives, rank 1 sends; rank 0 reports goodput from accept to the last byte."""
    rank, addr = int(os.environ["RANK"]), os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    if rank == 0:
        with socket.create_server((addr, port)) as server:
            conn, peer = server.accept()
            start, got = time.perf_counter(), 0
            with conn:
                while chunk := conn.recv(1 << 20):
                    got += len(chunk)
            seconds = time.perf_counter() - start
        assert got == nbytes, (got, nbytes)
        print(f"TCP_BPS {got * 8 / seconds:.0f} bytes={got} seconds={seconds:.4f} peer={peer[0]}",
              flush=True)
    elif rank == 1:
        payload = b"\0" * nbytes
        deadline = time.monotonic() + 20
        while True:  # rank 0 may not listen yet
            try:
                conn = socket.create_connection((addr, port), timeout=30)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with conn:
            conn.sendall(payload)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "allreduce":
        allreduce()
    elif mode == "tcp":
        tcp(int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}; use allreduce or tcp NBYTES")
