"""Command line: parse, build the plan, bring it up, run the ranks, always tear down."""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType

from . import netns
from .launch import RankGroup, say
from .plan import ClusterPlan, NetclusterError, parse_rate, shell_line

USAGE = """netcluster --ranks N [--rate 1gbit] [--straggler-rank R --straggler-rate 100mbit]
                  [--prefix ntc] [--subnet 10.77.0.0/24] [--port 29500] [--out DIR]
                  [--grace S] [--timeout S] [--omp-threads T] [--dry-run] -- COMMAND ARGS...
       netcluster --cleanup PREFIX [--force]"""

EPILOG = """Each rank runs, in the current directory:
  ip netns exec <ns> env MASTER_ADDR=.. MASTER_PORT=.. RANK=.. WORLD_SIZE=.. LOCAL_RANK=0
      LOCAL_WORLD_SIZE=1 GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=..
      NETCLUSTER_RANK=.. NETCLUSTER_ADDR=.. NETCLUSTER_RATE=.. COMMAND ARGS...
Example:
  sudo scripts/netcluster --ranks 4 --rate 100mbit --out runs/net -- .venv/bin/python -m scape_train
Exit status: 0 when every rank succeeds; else the first failing rank's (128+N if it was killed
by signal N); 124 on --timeout; 128+N when netcluster itself got signal N; 2 for a usage or
setup error."""

_seq = itertools.count()  # several clusters from one process get distinct names


class Interrupted(BaseException):
    """Raised from a signal handler so that every ``finally`` runs (the default SIGTERM action
    would kill us without tearing anything down)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signum)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="netcluster", usage=USAGE, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Run COMMAND once per rank, each rank in its own "
                                "network namespace behind a rate-limited link, all on one bridge.")
    p.add_argument("--ranks", type=int, help="number of ranks (namespaces)")
    p.add_argument("--rate", default="1gbit",
                   help="each rank's link rate in both directions (tc units: 100mbit, 1gbit, ...; "
                   "'none' = unlimited); default 1gbit")
    p.add_argument("--straggler-rank", type=int, help="one rank whose link gets --straggler-rate")
    p.add_argument("--straggler-rate", help="the straggler's link rate, e.g. 100mbit")
    p.add_argument("--prefix", default="ntc", help="namespace name prefix; names are "
                   "<prefix>-<pid>-<n>-r<rank> and <prefix>-<pid>-<n>-br (default ntc)")
    p.add_argument("--subnet", default="10.77.0.0/24", help="addresses inside the cluster; rank i "
                   "gets host i+1; never routed to the host, so any private subnet works")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT (default 29500)")
    p.add_argument("--out", help="directory for rank{i}.log (default: a new temporary directory)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the other ranks get after one fails, before they are stopped")
    p.add_argument("--timeout", type=float,
                   help="stop everything after this many seconds (exit 124)")
    p.add_argument("--omp-threads", type=int, default=1,
                   help="OMP_NUM_THREADS per rank (default 1)")
    p.add_argument("--stream-rank", type=int, default=0,
                   help="rank whose output also goes to the console (default 0)")
    p.add_argument("--dry-run", action="store_true", help="print the ip/tc commands and exit")
    p.add_argument("--cleanup", metavar="PREFIX", help="remove namespaces left by dead runs whose "
                   "names start with PREFIX, then exit")
    p.add_argument("--force", action="store_true", help="with --cleanup: also remove namespaces "
                   "of netcluster processes that still run")
    return p


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def plan_from_args(args: argparse.Namespace, command: list[str]) -> ClusterPlan:
    if args.ranks is None:
        raise NetclusterError("--ranks N is required")
    if not command:
        raise NetclusterError("give the command to run after --, e.g. -- .venv/bin/python train.py")
    if (args.straggler_rank is None) != (args.straggler_rate is None):
        raise NetclusterError("--straggler-rank and --straggler-rate go together")
    if args.omp_threads < 1:
        raise NetclusterError("--omp-threads must be at least 1")
    if not 0 <= args.stream_rank < args.ranks:
        raise NetclusterError(f"--stream-rank must be a rank of 0..{args.ranks - 1}")
    straggler_rate = parse_rate(args.straggler_rate) if args.straggler_rate is not None else None
    tag = f"{args.prefix}-{os.getpid()}-{next(_seq)}"
    return ClusterPlan.build(args.ranks, tag, subnet=args.subnet, rate=parse_rate(args.rate),
                             straggler_rank=args.straggler_rank, straggler_rate=straggler_rate,
                             port=args.port, omp_threads=args.omp_threads)


def print_dry_run(plan: ClusterPlan, command: list[str]) -> None:
    print("# " + plan.describe().replace("\n", "\n# "))
    print("# set up")
    for argv in plan.setup_commands():
        print(shell_line(argv))
    print("# run (one per rank, in parallel)")
    for rank in range(plan.ranks):
        print(shell_line(plan.rank_command(rank, command)) + " &")
    print("wait\n# tear down (first: kill whatever is left in each namespace, see `ip netns pids`)")
    for argv in plan.teardown_commands():
        print(shell_line(argv))


def run_cluster(plan: ClusterPlan, command: list[str], out_dir: Path, grace_s: float,
                timeout_s: float | None, stream_rank: int = 0) -> int:
    """Bring the cluster up, run the ranks, and tear it all down whatever happens."""
    netns.check_prerequisites()
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in _HANDLED}
    commands = [plan.rank_command(rank, command) for rank in range(plan.ranks)]
    group = RankGroup(commands, out_dir, stream_rank)
    made: list[str] = []  # namespaces this run created
    try:
        say(plan.describe().replace("\n", "\nnetcluster: "))
        netns.bring_up(plan, made)
        say(f"logs in {out_dir}/rank{{0..{plan.ranks - 1}}}.log; console shows rank {stream_rank}")
        group.start()
        return group.wait(grace_s, timeout_s)
    except Interrupted as stop:
        say(f"got {stop}; stopping ranks and removing the namespaces")
        return 128 + stop.signum
    finally:
        # Ignore further signals while cleaning up, so a second Ctrl-C cannot leave half a cluster.
        for sig in _HANDLED:
            signal.signal(sig, signal.SIG_IGN)
        try:
            group.stop()
            group.close()
            netns.tear_down(made)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    own, command = split_command(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        if args.cleanup is not None:
            netns.check_prerequisites()
            removed, kept = netns.cleanup(args.cleanup, force=args.force)
            for name in removed:
                print(f"removed {name}")
            for name in kept:
                print(f"kept {name} (its netcluster process still runs; --force removes it)")
            return 0
        plan = plan_from_args(args, command)
        if args.dry_run:
            print_dry_run(plan, command)
            return 0
        out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="netcluster-"))
        rc = run_cluster(plan, command, out_dir, args.grace, args.timeout, args.stream_rank)
        say(f"done, exit code {rc}")
        return rc
    except NetclusterError as err:
        print(f"netcluster: error: {err}", file=sys.stderr)
        return 2
