"""Carry out a ClusterPlan on this machine: check prerequisites, bring up, tear down, clean up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from .plan import NAME_RE, Argv, ClusterPlan, NetclusterError, shell_line

INSTALL_HINT = "install iproute2 (Debian/Ubuntu: apt-get install iproute2)"


def check_prerequisites(euid: int | None = None,
                        which: Callable[[str], str | None] = shutil.which) -> None:
    """Fail early, with what to do, when this machine cannot build namespaces."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise NetclusterError(
            "netcluster must run as root: network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN. "
            "Run it with sudo (sudo -E keeps your environment), or add --dry-run to print the "
            "ip/tc commands without running them.")
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        raise NetclusterError(f"{' and '.join(missing)} not found on PATH; {INSTALL_HINT}")


def _explain(argv: Argv, stderr: str) -> str:
    """Turn the common failures of ip/tc into what to do about them."""
    if argv[0] == "tc" and ("qdisc kind is unknown" in stderr or "Unknown qdisc" in stderr):
        return ("this kernel has no tbf qdisc (module sch_tbf): load it with `modprobe sch_tbf`, "
                "or run without shaping (--rate none)")
    if "Operation not permitted" in stderr:
        return ("not permitted: run as root (a container needs CAP_NET_ADMIN and "
                "CAP_SYS_ADMIN)")
    if "File exists" in stderr:
        return ("a namespace of that name exists: remove leftovers with "
                "`netcluster --cleanup PREFIX`")
    return ""


def run_checked(argv: Argv) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        hint = _explain(argv, proc.stderr)
        raise NetclusterError(f"`{shell_line(argv)}` failed (exit {proc.returncode}): "
                              f"{proc.stderr.strip()}" + (f"\n  -> {hint}" if hint else ""))
    return proc.stdout


def list_namespaces() -> list[str]:
    # Lines look like "name (id: 3)" or just "name".
    lines = run_checked(["ip", "netns", "list"]).splitlines()
    return [line.split()[0] for line in lines if line.strip()]


def bring_up(plan: ClusterPlan, made: list[str]) -> None:
    """Run the setup commands, listing in ``made`` each namespace this run creates, so that
    tear_down(made) removes exactly those, also after a failure or a signal half-way."""
    for argv in plan.setup_commands():
        adds = argv[:3] == ["ip", "netns", "add"]
        if adds:
            made.append(argv[3])  # before running: a signal may land after ip made it
        try:
            run_checked(argv)
        except NetclusterError:
            if adds:  # it was not ours (e.g. "File exists"): never delete it
                made.pop()
            raise


def _kill_inside(ns: str) -> None:
    """Kill every process still in the namespace: a live process keeps a deleted namespace (and
    its veth and bridge) alive, unnamed and invisible to `ip netns list`."""
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    for pid in (int(p) for p in proc.stdout.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def delete_namespaces(names: list[str]) -> list[str]:
    """Best effort on every name, even when one fails; returns the error messages."""
    errors = []
    for ns in names:
        _kill_inside(ns)
        proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0 and "No such file" not in proc.stderr:
            errors.append(f"ip netns del {ns}: {proc.stderr.strip()}")
    return errors


def tear_down(made: list[str]) -> None:
    existing = set(list_namespaces())
    for message in delete_namespaces([ns for ns in made if ns in existing]):
        print(f"netcluster: teardown: {message}", file=sys.stderr)


def _owner_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(prefix: str, force: bool = False) -> tuple[list[str], list[str]]:
    """Remove namespaces left by runs whose names start with ``prefix`` (e.g. after ``kill -9``).

    A namespace whose netcluster process still runs is kept unless ``force``: a live cluster of
    another run is not a leftover. Returns (removed, kept).
    """
    removed, kept = [], []
    for name in list_namespaces():
        match = NAME_RE.match(name)
        if not name.startswith(prefix) or match is None:
            continue
        if not force and _owner_alive(int(match.group("pid"))):
            kept.append(name)
            continue
        removed.append(name)
    # Ranks before bridges is not required (either end removes a veth); retry once for races.
    errors = delete_namespaces(removed)
    if errors:
        time.sleep(0.2)
        errors = delete_namespaces([n for n in removed if n in set(list_namespaces())])
        if errors:
            raise NetclusterError("cleanup failed:\n  " + "\n  ".join(errors))
    return removed, kept
