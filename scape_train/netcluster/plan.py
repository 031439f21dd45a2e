"""What a cluster is: namespace names, addresses, link rates, and the exact ip/tc commands.

Everything here is pure (no system calls), so ``--dry-run`` prints exactly what a real run executes
and the tests can inspect the commands without root.

Topology (one bridge namespace, one namespace per rank)::

    ns <tag>-r0: eth0 10.77.0.1 ──veth── p0 ┐
    ns <tag>-r1: eth0 10.77.0.2 ──veth── p1 ├─ br0   (ns <tag>-br)
    ...                                      ┘

Each veth is created directly inside its two namespaces (``ip -n RANK link add eth0 ... peer name pI
netns BRIDGE``), so nothing is ever added to the host's own network namespace: parallel clusters
never collide on interface names, and addresses exist only inside the namespaces (the default
subnet cannot clash with the host's routes because no namespace here has a route to the host).

Shaping: a token bucket (``tc tbf``) on both ends of each rank's veth.
  * ``eth0`` in the rank's namespace limits what the rank SENDS (egress);
  * ``pI`` in the bridge namespace limits what the bridge forwards TO the rank (its ingress).
So every rank's link is limited to the rate in each direction, like a full-duplex NIC. The
straggler's link gets its own rate in both directions. tbf shapes whole frames (Ethernet header
included), so TCP goodput is a few per cent under the nominal rate (19.6 of 20 Mbit/s here).
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass

Argv = list[str]

# tc's own unit names: "bit"-units are bits per second, "bps"-units are BYTES per second.
_RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9,
}
_UNLIMITED = ("none", "unlimited", "off")
# Why these tbf parameters: the bucket must hold at least one 64 KiB GSO/TSO frame (veths hand tbf
# such super-frames; smaller buckets make tbf split them) and ~10 ms of traffic, so the timer
# resolution never limits the rate; the 50 ms queue absorbs bursts from several senders.
_MIN_BURST_BYTES = 64 * 1024
_BURST_SECONDS = 0.010
TBF_LATENCY = "50ms"

RANK_IFNAME = "eth0"  # the interface name every rank sees (GLOO/NCCL_SOCKET_IFNAME)
BRIDGE_IFNAME = "br0"
NAME_RE = re.compile(r"^(?P<tag>.+-(?P<pid>\d+)-\d+)-(?:br|r\d+)$")  # names made by ClusterPlan


class NetclusterError(RuntimeError):
    """A problem the user can fix; the message says how."""


def parse_rate(text: str) -> int | None:
    """``"100mbit"`` -> 100_000_000 (bits per second); ``"none"`` -> None (no shaping)."""
    value = text.strip().lower()
    if value in _UNLIMITED:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", value)
    if not match or match.group(2) not in _RATE_UNITS:
        raise NetclusterError(
            f"bad rate {text!r}: use a number with a tc unit, e.g. 100mbit, 1gbit, 500kbit, 10mbps "
            f"(mbps = megaBYTES/s), or 'none' for an unlimited link")
    bits = round(float(match.group(1)) * _RATE_UNITS[match.group(2)])
    if bits < 8000:
        raise NetclusterError(f"rate {text!r} is below 8kbit; tbf cannot shape that slowly")
    return bits


def format_rate(bits: int | None) -> str:
    if bits is None:
        return "none"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


def tbf_args(bits: int) -> Argv:
    burst = max(_MIN_BURST_BYTES, int(bits / 8 * _BURST_SECONDS))
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", TBF_LATENCY]


@dataclass(frozen=True)
class ClusterPlan:
    """N rank namespaces on one bridge namespace, with per-rank link rates (bits/s, None = free)."""

    ranks: int
    tag: str  # "<prefix>-<pid>-<seq>": unique per run, the start of every namespace name
    subnet: ipaddress.IPv4Network
    rates: tuple[int | None, ...]
    port: int = 29500
    omp_threads: int = 1

    @classmethod
    def build(cls, ranks: int, tag: str, subnet: str = "10.77.0.0/24", rate: int | None = None,
              straggler_rank: int | None = None, straggler_rate: int | None = None,
              port: int = 29500, omp_threads: int = 1) -> ClusterPlan:
        if ranks < 1:
            raise NetclusterError(f"--ranks must be at least 1, got {ranks}")
        try:
            net = ipaddress.IPv4Network(subnet, strict=True)
        except ValueError as err:
            raise NetclusterError(
                f"bad --subnet {subnet!r}: {err} (example: 10.77.0.0/24)") from None
        if net.num_addresses - 2 < ranks:
            room = max(net.num_addresses - 2, 0)
            raise NetclusterError(f"--subnet {subnet} has room for {room} hosts, not {ranks} "
                                  "ranks; use a larger one such as 10.77.0.0/16")
        if not 1 <= port <= 65535:
            raise NetclusterError(f"--port must be in 1..65535, got {port}")
        rates = [rate] * ranks
        if straggler_rank is not None:
            if not 0 <= straggler_rank < ranks:
                raise NetclusterError(
                    f"--straggler-rank {straggler_rank} is not a rank of 0..{ranks - 1}")
            rates[straggler_rank] = straggler_rate
        return cls(ranks=ranks, tag=tag, subnet=net, rates=tuple(rates), port=port,
                   omp_threads=omp_threads)

    # --- names and addresses -------------------------------------------------------------------
    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    def rank_ns(self, rank: int) -> str:
        return f"{self.tag}-r{rank}"

    def namespaces(self) -> list[str]:
        return [self.rank_ns(r) for r in range(self.ranks)] + [self.bridge_ns]

    def address(self, rank: int) -> str:
        return str(self.subnet.network_address + 1 + rank)

    @property
    def master_addr(self) -> str:
        return self.address(0)

    # --- commands ------------------------------------------------------------------------------
    def setup_commands(self) -> list[Argv]:
        br = self.bridge_ns
        cmds: list[Argv] = [
            ["ip", "netns", "add", br],
            ["ip", "-n", br, "link", "add", BRIDGE_IFNAME, "type", "bridge"],
            ["ip", "-n", br, "link", "set", BRIDGE_IFNAME, "up"],
        ]
        for rank in range(self.ranks):
            ns, port = self.rank_ns(rank), f"p{rank}"
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "-n", ns, "link", "add", RANK_IFNAME, "type", "veth",
                 "peer", "name", port, "netns", br],
                ["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/{self.subnet.prefixlen}",
                 "dev", RANK_IFNAME],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", RANK_IFNAME, "up"],
                ["ip", "-n", br, "link", "set", port, "master", BRIDGE_IFNAME],
                ["ip", "-n", br, "link", "set", port, "up"],
            ]
            bits = self.rates[rank]
            if bits is not None:  # egress of the rank, then its ingress (the bridge's port to it)
                for where, dev in ((ns, RANK_IFNAME), (br, port)):
                    cmds.append(["tc", "-n", where, "qdisc", "add", "dev", dev, "root",
                                 *tbf_args(bits)])
        return cmds

    def teardown_commands(self) -> list[Argv]:
        """Deleting a namespace destroys its interfaces; a veth dies with either end, the bridge
        with its namespace. (Processes still inside are killed first, see netns.tear_down.)"""
        return [["ip", "netns", "del", ns] for ns in self.namespaces()]

    def rank_env(self, rank: int) -> dict[str, str]:
        return {
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.port),
            "RANK": str(rank), "WORLD_SIZE": str(self.ranks),
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GLOO_SOCKET_IFNAME": RANK_IFNAME, "NCCL_SOCKET_IFNAME": RANK_IFNAME,
            "OMP_NUM_THREADS": str(self.omp_threads),
            "NETCLUSTER_RANK": str(rank), "NETCLUSTER_ADDR": self.address(rank),
            "NETCLUSTER_RATE": format_rate(self.rates[rank]),
        }

    def rank_command(self, rank: int, command: Argv) -> Argv:
        """``ip netns exec`` keeps the filesystem and working directory, so relative paths such as
        ``.venv/bin/python`` resolve as in the caller's shell; the rest of the environment is
        inherited, these variables are added."""
        env = [f"{k}={v}" for k, v in self.rank_env(rank).items()]
        return ["ip", "netns", "exec", self.rank_ns(rank), "env", *env, *command]

    def describe(self) -> str:
        lines = [f"netcluster {self.tag}: {self.ranks} ranks on {self.subnet}, "
                 f"master {self.master_addr}:{self.port}"]
        for rank in range(self.ranks):
            bits = self.rates[rank]
            link = "unlimited" if bits is None else f"{format_rate(bits)} each way"
            lines.append(f"  rank {rank}: ns {self.rank_ns(rank)}  {self.address(rank)}  "
                         f"link {link}")
        return "\n".join(lines)


def shell_line(argv: Argv) -> str:
    return shlex.join(argv)
