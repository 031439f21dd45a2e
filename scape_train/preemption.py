"""Preemption: a SIGTERM/SIGINT becomes a checkpoint at the end of the current step.

The signal, torchrun's agent (which SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds
after forwarding the signal) and the save are made to fit in one place: ``scripts/preemption.sh``.
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger("scape_train")


class StopSignal:
    """SIGTERM/SIGINT (preemption) set a flag; the ranks agree on it with the step's loss, and
    the loop checkpoints at the end of that step.

    A second signal stops at once, unless it comes within ``REPEAT_S`` of the first: that is the
    same request delivered twice (Slurm signals every process of a job step, and torchrun's agent
    forwards the signal it got to its workers), and the checkpoint must survive it."""

    REPEAT_S = 10.0

    def __init__(self):
        self.requested = False     # this process got a signal (set by the handler, at any time)
        # every rank's requests as the step's agreement read them: the loop acts on this alone,
        # since a signal landing between the agreement and the loop's check would otherwise
        # send one rank to checkpoint while the others train on (a collective mismatch)
        self.agreed = False
        self._first: float | None = None     # monotonic time of this process's first signal
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a worker): no handler
                pass
        return self

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self._first is not None:
            if now - self._first > self.REPEAT_S:   # someone insists: stop at once
                raise KeyboardInterrupt
            log.warning("signal %d again after %.1f s: the same request, delivered twice; still "
                        "checkpointing", signum, now - self._first)
            return
        log.warning("signal %d received: checkpointing at the end of this step, then exiting", signum)
        self._first = now
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def warn_if_save_outlasts_the_agent(seconds: float) -> None:
    """Under torchrun a preemption signal gives the workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    seconds (torch's default: 30) to finish the step and save before the agent kills them."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    limit = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    if seconds > limit / 2:
        log.warning("this checkpoint took %.0f s; after a preemption signal torchrun's agent kills "
                    "the workers at %.0f s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT): raise it and the "
                    "signal's lead time together (scripts/preemption.sh)", seconds, limit)
