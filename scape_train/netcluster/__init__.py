"""netcluster: a bandwidth-limited multi-host cluster on one Linux machine (needs root).

    sudo scripts/netcluster --ranks 4 --rate 100mbit -- .venv/bin/python -m scape_train ...

Every rank runs in its own network namespace with one interface, ``eth0``, and its own address
(10.77.0.1 for rank 0, ...), all joined by a bridge in one more namespace. Each rank's link is
shaped with ``tc tbf`` in both directions (``--rate``; ``--straggler-rank/--straggler-rate`` give
one rank a slower link), so collectives between ranks cross a real, rate-limited TCP/IP path
instead of loopback or shared memory. The ranks get the torch.distributed variables (MASTER_ADDR,
RANK, WORLD_SIZE, GLOO_SOCKET_IFNAME=eth0, ...); ``init_process_group("gloo")`` needs nothing else.

Files: ``plan.py`` (names, addresses, the ip/tc commands; pure), ``netns.py`` (runs them, teardown,
``--cleanup``), ``launch.py`` (rank processes and logs), ``cli.py`` (arguments, signals).

Guarantees: the namespaces, veths and bridge are removed when the command ends, fails, or
netcluster gets SIGINT/SIGTERM/SIGHUP; only ``kill -9`` can leave them, and
``netcluster --cleanup ntc`` removes those. Nothing is added to the host's own network namespace.

Limits: tbf shapes bandwidth only (no latency or loss: netem is not available everywhere). With
NCCL all ranks still see the same host and GPUs, so NCCL would pick shared memory/P2P over the
network; set NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (before the command, inherited) to force its
socket transport. Must be called from the main thread (it installs signal handlers).
"""

from .cli import main, run_cluster
from .plan import ClusterPlan, NetclusterError, format_rate, parse_rate

__all__ = ["ClusterPlan", "NetclusterError", "format_rate", "main", "parse_rate", "run_cluster"]
