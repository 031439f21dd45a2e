"""Run one process per rank, log each to <out>/rank{i}.log, stream one to the console, reap them.

Every rank starts in its own session (process group), so Ctrl-C at the terminal reaches only the
netcluster process, which then stops the ranks in order: SIGTERM to each group, SIGKILL after a
few seconds. Processes that escape their group are killed by the namespace teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from .plan import Argv

_POLL_S = 0.05
_TERM_TO_KILL_S = 3.0
TIMEOUT_EXIT = 124  # like coreutils `timeout`


def say(message: str) -> None:
    print(f"netcluster: {message}", file=sys.stderr, flush=True)


def exit_code(returncode: int) -> int:
    """A rank killed by signal N reads as 128+N, the shell's convention."""
    return 128 - returncode if returncode < 0 else returncode


class RankGroup:
    def __init__(self, commands: list[Argv], out_dir: Path, stream_rank: int = 0) -> None:
        self.commands = commands
        self.out_dir = out_dir
        self.stream_rank = stream_rank
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[BinaryIO] = []
        self._tee: threading.Thread | None = None

    def log_path(self, rank: int) -> Path:
        return self.out_dir / f"rank{rank}.log"

    def start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for rank, argv in enumerate(self.commands):
            log = open(self.log_path(rank), "wb")  # noqa: SIM115 - closed in close()
            self._logs.append(log)
            streamed = rank == self.stream_rank
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if streamed else log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(proc)
            if streamed:
                self._tee = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True)
                self._tee.start()

    def wait(self, grace_s: float, timeout_s: float | None) -> int:
        """Wait for every rank. When one fails, give the others ``grace_s`` to finish (they often
        fail too, with a useful message), then stop them. Returns 0 or the first failure's code."""
        start = time.monotonic()
        failure: tuple[int, int] | None = None  # (rank, returncode)
        stop_at: float | None = None
        while [p.poll() for p in self.procs].count(None):  # a list: poll every rank, each pass
            now = time.monotonic()
            for rank, proc in enumerate(self.procs):
                if failure is None and proc.returncode not in (None, 0):
                    failure = (rank, proc.returncode)
                    say(f"rank {rank} failed with exit code {exit_code(proc.returncode)} "
                         f"(log: {self.log_path(rank)}); stopping the others in {grace_s:g} s")
                    stop_at = now + grace_s
            if stop_at is not None and now >= stop_at:
                self.stop()
                break
            if timeout_s is not None and now - start >= timeout_s:
                say(f"timeout after {timeout_s:g} s; stopping all ranks")
                self.stop()
                return TIMEOUT_EXIT
            time.sleep(_POLL_S)
        if failure is None:  # the last ranks may have failed in the same poll that ended the loop
            failed = [(r, p.returncode) for r, p in enumerate(self.procs) if p.returncode]
            failure = failed[0] if failed else None
        return 0 if failure is None else exit_code(failure[1])

    def stop(self) -> None:
        """SIGTERM every live rank's process group, SIGKILL what is left after a few seconds."""
        live = [p for p in self.procs if p.poll() is None]
        for proc in live:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + _TERM_TO_KILL_S
        while time.monotonic() < deadline and None in [p.poll() for p in live]:
            time.sleep(_POLL_S)
        for proc in live:
            _signal_group(proc.pid, signal.SIGKILL)  # also reaches children left in the group
            proc.wait()

    def close(self) -> None:
        if self._tee is not None:
            self._tee.join(timeout=5)
        for log in self._logs:
            log.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tee(pipe: BinaryIO, log: BinaryIO) -> None:
    console = sys.stdout.buffer
    fd = pipe.fileno()
    while chunk := os.read(fd, 65536):
        log.write(chunk)
        log.flush()
        try:
            console.write(chunk)
            console.flush()
        except (BrokenPipeError, ValueError):  # console gone: keep logging to the file
            pass
    pipe.close()
