"""scripts/netcluster: plan and arguments (anywhere), and real namespaces (root, marker netns).

The netns tests skip when not root or without ip/tc, except under CI=true as root with ip, where
a missing piece is a failure: CI must exercise them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scape_train.netcluster import ClusterPlan, NetclusterError, main, parse_rate, run_cluster
from scape_train.netcluster.netns import check_prerequisites, run_checked

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "scripts" / "netcluster"
PROBE = "tests/_netcluster_probe.py"  # relative: ranks run in the caller's working directory


# --- anywhere: rates, plan, arguments ------------------------------------------------------------

def test_parse_rate_units() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 1_000_000_000
    assert parse_rate("1.5Mbit") == 1_500_000
    assert parse_rate("10mbps") == 80_000_000  # tc: mbps = megaBYTES per second
    assert parse_rate("none") is None
    for bad in ("100", "fast", "10 parsecs", "1bit"):
        with pytest.raises(NetclusterError):
            parse_rate(bad)


def test_plan_shapes_both_directions_and_straggler() -> None:
    plan = ClusterPlan.build(3, "t-1-0", rate=parse_rate("1gbit"), straggler_rank=2,
                             straggler_rate=parse_rate("100mbit"))
    tbf = [c for c in plan.setup_commands() if c[0] == "tc"]
    # one tbf on the rank's eth0 (egress) and one on its bridge port (ingress), per rank
    shaped = {(c[2], c[6], c[c.index("rate") + 1]) for c in tbf}
    assert shaped == {("t-1-0-r0", "eth0", "1000000000bit"), ("t-1-0-br", "p0", "1000000000bit"),
                      ("t-1-0-r1", "eth0", "1000000000bit"), ("t-1-0-br", "p1", "1000000000bit"),
                      ("t-1-0-r2", "eth0", "100000000bit"), ("t-1-0-br", "p2", "100000000bit")}
    assert [plan.address(r) for r in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    env = plan.rank_env(2)
    assert env["MASTER_ADDR"] == "10.77.0.1" and env["RANK"] == "2" and env["WORLD_SIZE"] == "3"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
    unlimited = ClusterPlan.build(2, "t-1-1", rate=None)
    assert not [c for c in unlimited.setup_commands() if c[0] == "tc"]
    # every interface is made inside a namespace: nothing in the host's
    assert all(c[:3] == ["ip", "netns", "add"] or c[1] == "-n" for c in plan.setup_commands())


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(NetclusterError, match="room for 2 hosts"):
        ClusterPlan.build(4, "t-1-0", subnet="10.0.0.0/30")
    with pytest.raises(NetclusterError, match="straggler-rank 5"):
        ClusterPlan.build(2, "t-1-0", straggler_rank=5, straggler_rate=None)


def test_dry_run_prints_commands(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--ranks", "2", "--rate", "20mbit", "--prefix", "dry", "--dry-run", "--",
               "python", "-c", "print(1)"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"^tc -n dry-\d+-\d+-br qdisc add dev p1 root tbf rate 20000000bit", out, re.M)
    assert re.search(r"^ip netns exec dry-\d+-\d+-r1 env MASTER_ADDR=10.77.0.1 .* RANK=1 .*"
                     r"python -c 'print\(1\)' &$", out, re.M)
    assert re.search(r"^ip netns del dry-\d+-\d+-br$", out, re.M)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ranks", "2", "--dry-run"]) == 2
    assert "give the command to run after --" in capsys.readouterr().err
    assert main(["--ranks", "2", "--straggler-rank", "1", "--dry-run", "--", "true"]) == 2
    assert "go together" in capsys.readouterr().err


def test_prerequisite_messages() -> None:
    with pytest.raises(NetclusterError, match="must run as root"):
        check_prerequisites(euid=1000, which=shutil.which)
    with pytest.raises(NetclusterError, match="tc not found.*apt-get install iproute2"):
        check_prerequisites(euid=0, which=lambda tool: None if tool == "tc" else f"/bin/{tool}")


# --- root: real namespaces ------------------------------------------------------------------------

def _missing() -> str | None:
    if os.geteuid() != 0:
        return "not root: network namespaces need root (run the suite with sudo to include these)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found; install it with apt-get install iproute2"
    probe = f"nctprobe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def netns_host() -> None:
    reason = _missing()
    if reason is None:
        return
    if os.environ.get("CI") == "true" and os.geteuid() == 0 and shutil.which("ip"):
        pytest.fail(f"CI=true as root with ip: the netns tests must run, but {reason}")
    pytest.skip(reason)


def _links() -> set[str]:
    """Interfaces in the host's own namespace (netcluster must never add one there)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def _namespaces(start: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(start)]


def _procs_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            # the netcluster process itself carries the marker in its argv: not a rank
            if marker.encode() in cmdline and b"scripts/netcluster" not in cmdline:
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(TOOL), *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run(args: list[str], timeout: float = 45) -> tuple[int, str, str, int]:
    proc = _start(args)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err, proc.pid


def _assert_clean(tag: str, links_before: set[str], marker: str | None = None) -> None:
    assert _namespaces(tag) == [], f"namespaces left: {_namespaces(tag)}"
    assert _links() == links_before, f"host links changed: {_links() ^ links_before}"
    if marker is not None:
        assert _procs_with(marker) == [], "rank processes left running"


def _sleeper(marker: str, fail_rank: int | None = None) -> list[str]:
    fail = "" if fail_rank is None else (
        f'if [ "$RANK" = {fail_rank} ]; then echo failing; exit 3; fi; ')
    return ["sh", "-c", f"{fail}echo rank $RANK up; sleep {marker}"]


def _marker() -> str:
    return f"97.{time.time_ns() % 10**9}"  # a sleep length no other process uses


@pytest.mark.netns
def test_gloo_allreduce_across_namespaces(netns_host: None, tmp_path: Path) -> None:
    before = _links()
    rc, out, err, pid = _run(["--ranks", "2", "--rate", "1gbit", "--prefix", "nctar",
                              "--out", str(tmp_path), "--timeout", "40", "--",
                              sys.executable, PROBE, "allreduce"])
    assert rc == 0, err
    assert "ALLREDUCE_OK rank=0 world=2 value=3 addr=10.77.0.1" in out  # rank 0 is streamed
    assert "rank=1" not in out
    rank1 = (tmp_path / "rank1.log").read_text()
    assert "ALLREDUCE_OK rank=1 world=2 value=3 addr=10.77.0.2" in rank1
    assert "ALLREDUCE_OK rank=0" in (tmp_path / "rank0.log").read_text()
    _assert_clean(f"nctar-{pid}-", before)


def _tcp_bps(args: list[str], tmp_path: Path, nbytes: int) -> tuple[float, str]:
    """Goodput rank 1 -> rank 0 (bits/s), and the run's namespace tag."""
    rc, out, err, pid = _run(["--ranks", "2", "--prefix", "nctbw", "--out", str(tmp_path),
                            "--timeout", "30", *args,
                            "--", sys.executable, PROBE, "tcp", str(nbytes)])
    assert rc == 0, err + (tmp_path / "rank1.log").read_text()
    match = re.search(r"TCP_BPS (\d+)", out)
    assert match, out
    return float(match.group(1)), f"nctbw-{pid}-"


@pytest.mark.netns
def test_rate_limit_takes_effect_both_ways(netns_host: None, tmp_path: Path) -> None:
    before = _links()
    nbytes = 2_500_000  # 1 s at 20 Mbit/s
    free, tag0 = _tcp_bps(["--rate", "none"], tmp_path, nbytes)
    limited, tag1 = _tcp_bps(["--rate", "20mbit"], tmp_path, nbytes)  # sender's egress
    # only the receiver (rank 0) is slow: its ingress, shaped on the bridge side, must limit
    ingress, tag2 = _tcp_bps(["--rate", "none", "--straggler-rank", "0",
                              "--straggler-rate", "20mbit"], tmp_path, nbytes)
    for bps in (limited, ingress):
        # goodput sits a few % under the nominal rate (headers); the bucket allows a small burst
        assert 0.75 * 20e6 < bps < 1.1 * 20e6, (bps, free)
    assert free > 10 * limited, (free, limited)
    for tag in (tag0, tag1, tag2):
        _assert_clean(tag, before)


@pytest.mark.netns
def test_failing_rank_stops_all_and_cleans_up(netns_host: None, tmp_path: Path) -> None:
    before, marker = _links(), _marker()
    start = time.monotonic()
    rc, _, err, pid = _run(["--ranks", "2", "--grace", "0.5", "--prefix", "nctfail",
                            "--out", str(tmp_path), "--", *_sleeper(marker, fail_rank=1)])
    assert rc == 3, err
    assert "rank 1 failed with exit code 3" in err
    assert time.monotonic() - start < 20  # rank 0 (sleeping 97 s) was stopped, not waited for
    assert "failing" in (tmp_path / "rank1.log").read_text()
    _assert_clean(f"nctfail-{pid}-", before, marker)


def _wait_ranks_running(out_dir: Path, ranks: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 20
    logs = [out_dir / f"rank{r}.log" for r in range(ranks)]
    while not all(log.exists() and "up" in log.read_text() for log in logs):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)


@pytest.mark.netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_tears_down(netns_host: None, tmp_path: Path, sig: signal.Signals) -> None:
    before, marker = _links(), _marker()
    proc = _start(["--ranks", "2", "--prefix", "nctsig", "--out", str(tmp_path), "--",
                   *_sleeper(marker)])
    _wait_ranks_running(tmp_path, 2, proc)
    assert len(_namespaces(f"nctsig-{proc.pid}-")) == 3  # two ranks and the bridge
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig, err
    _assert_clean(f"nctsig-{proc.pid}-", before, marker)


@pytest.mark.netns
def test_cleanup_after_kill9(netns_host: None, tmp_path: Path) -> None:
    before, marker = _links(), _marker()
    proc = _start(["--ranks", "2", "--prefix", "nctk9", "--out", str(tmp_path), "--",
                   *_sleeper(marker)])
    _wait_ranks_running(tmp_path, 2, proc)
    tag = f"nctk9-{proc.pid}-"
    rc, out, _, _ = _run(["--cleanup", tag])
    assert rc == 0 and out.count("kept") == 3  # a live run is not a leftover
    proc.kill()  # no chance to tear down
    proc.communicate(timeout=10)
    assert len(_namespaces(tag)) == 3 and _procs_with(marker)  # the leftovers --cleanup is for
    rc, out, err, _ = _run(["--cleanup", tag])
    assert rc == 0, err
    assert out.count("removed") == 3
    deadline = time.monotonic() + 5  # SIGKILLed ranks vanish asynchronously
    while _procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    _assert_clean(tag, before, marker)


@pytest.mark.netns
def test_missing_qdisc_is_explained(netns_host: None) -> None:
    """A kernel without a qdisc fails in tc; netcluster must say how to fix it (sch_tbf)."""
    ns = f"nctq-{os.getpid()}-0-br"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        with pytest.raises(NetclusterError, match="modprobe sch_tbf"):
            run_checked(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "nosuchqdisc"])
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)


@pytest.mark.netns
def test_setup_failure_removes_only_what_it_made(netns_host: None, tmp_path: Path) -> None:
    before = _links()
    plan = ClusterPlan.build(2, f"nctup-{os.getpid()}-99", rate=parse_rate("20mbit"))
    foreign = plan.rank_ns(1)  # someone else's namespace where rank 1's will go
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        with pytest.raises(NetclusterError, match="File exists"):
            run_cluster(plan, ["true"], tmp_path, grace_s=1, timeout_s=10)
        assert _namespaces(plan.tag) == [foreign]  # bridge and rank 0 removed, the other kept
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=True)
    _assert_clean(plan.tag, before)
