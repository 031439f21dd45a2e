"""``python -m scape_train.elastic lighthouse``: the torchft lighthouse that forms each round's
quorum of elastic workers, until SIGTERM or Ctrl-C.

A quorum is formed when at least ``--min-replicas`` workers ask for one and either every member
of the previous quorum that is still alive asked too, or ``--join-timeout-ms`` passed since the
first asked. A worker whose heartbeats stop for ``--heartbeat-timeout-ms`` (killed, frozen) is
left out of the next quorum.
"""

from __future__ import annotations

import argparse
import signal
import threading


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=29510, help="port to listen on (29510)")
    parser.add_argument("--bind", default="[::]", help="address to listen on ([::]: all)")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="no quorum with fewer workers than this (1)")
    parser.add_argument("--join-timeout-ms", type=int, default=5000,
                        help="how long a quorum waits for live workers that have not asked yet")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                        help="a worker silent this long is taken for dead")
    parser.add_argument("--quorum-tick-ms", type=int, default=100,
                        help="how often a pending quorum is re-examined")


def serve(args: argparse.Namespace) -> None:
    from scape_train.elastic.replica import import_torchft

    import_torchft()
    from torchft.coordination import LighthouseServer

    if args.min_replicas < 1:
        raise SystemExit(f"--min-replicas must be >= 1, got {args.min_replicas}")
    server = LighthouseServer(bind=f"{args.bind}:{args.port}", min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms,
                              quorum_tick_ms=args.quorum_tick_ms,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"lighthouse listening at {server.address()} (min replicas {args.min_replicas}); "
          f"workers: strategy.elastic.lighthouse=http://localhost:{args.port}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        print("lighthouse stopped", flush=True)
