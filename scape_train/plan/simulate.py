"""A tiny allocation replay: the optimizer steps' transients, written in the order the code runs.

Optimizer state is an exact function of the parameter layout, and so are the temporaries of a
step -- but only their *order* says which of them are alive together. Each strategy's step is
written out below as the allocations and frees its code performs (``optim/dense.py``,
``optim/scape/replicated.py`` ...); ``Replay`` keeps the running total and its peak.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class Replay:
    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.where = "nothing"

    def alloc(self, nbytes: int, what: str) -> int:
        self.live += int(nbytes)
        if self.live > self.peak:
            self.peak, self.where = self.live, what
        return int(nbytes)

    def free(self, *nbytes: int) -> None:
        self.live -= sum(int(n) for n in nbytes)

    @contextlib.contextmanager
    def temp(self, nbytes: int, what: str) -> Iterator[None]:
        self.alloc(nbytes, what)
        try:
            yield
        finally:
            self.free(nbytes)

    def spike(self, nbytes: int, what: str) -> None:
        """A temporary freed before anything else is allocated."""
        with self.temp(nbytes, what):
            pass
