"""What DiLoCo and GASLoC share: the outer state and the outer update's arithmetic.

Both keep, per parameter, the round's starting point ``theta0`` (the anchor) and the previous
outer point ``y_prev``, and both write the outer step in the "y form" of the spec:

    y = theta0 - eta * delta              delta = theta0 - theta (drift, negated): y = theta0 + eta g
    x = y + gamma * (y - y_prev)          Nesterov extrapolation; y_prev <- y

DiLoCo averages ``delta`` over workers first (all-reduce), GASLoC on a sparse graph mixes ``x``
afterwards (gossip). On the complete graph GASLoC's mix ``sum_j x_j * (1/n)`` equals DiLoCo's
update only algebraically: 1/n is not exact in binary for n = 3, 5, 6, 7, ...; with different data
per worker it averages after the outer step what DiLoCo averages before it; and the backend's
all-reduce sums in an order of its own (gloo's sum at n = 3 and 4 is not the ascending-rank sum).
So there GASLoC runs DiLoCo's round itself, ``all_reduce_round`` below (the same all-reduce of the
drift, the same division by n, the same two functions after it): bit-for-bit DiLoCo's parameters
for every n, with the same data on every worker or each its own.
"""

from __future__ import annotations

import abc

from typing import Any

import torch

from scape_train.comm import Comm, Handle
from scape_train.host_to_device import pinned_zeros


def outer_point(anchor: torch.Tensor, delta: torch.Tensor, eta: float) -> torch.Tensor:
    """``y = theta0 - eta * delta``."""
    return torch.add(anchor, delta, alpha=-eta)


def extrapolate(y: torch.Tensor, y_prev: torch.Tensor, gamma: float) -> torch.Tensor:
    """``x = y + gamma * (y - y_prev)``."""
    return torch.add(y, y - y_prev, alpha=gamma)


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that later in-place updates cannot change (``.cpu()`` alone may alias)."""
    return t.detach().to("cpu", copy=True)


class PendingRound:
    """An overlapped round's exchange, started and not yet landed (``strategy.overlap_steps``).
    ``result()`` waits for it once and returns what it lands: DiLoCo's averaged drift
    (``what="delta"``) or a gossip round's mixed outer point (``what="point"``). ``local`` is this
    worker's own drift of the round (``overlap_merge=carry``), else None."""

    def __init__(self, what: str, handle: Handle | None, finish, local: torch.Tensor | None):
        self.what, self.local = what, local
        self._handle, self._finish, self._result = handle, finish, None

    @classmethod
    def ready(cls, what: str, result: torch.Tensor, local: torch.Tensor | None) -> "PendingRound":
        """One whose exchange has landed already (a checkpoint's)."""
        return cls(what, None, lambda: result, local)

    def result(self) -> torch.Tensor:
        if self._result is None:
            if self._handle is not None:
                self._handle.wait()
            self._result = self._finish()
        return self._result

    def state(self) -> dict[str, torch.Tensor]:
        """Its result (waited for) and own drift, as a checkpoint saves them."""
        local = {} if self.local is None else {"pending_local_delta": self.local}
        return {f"pending_{self.what}": self.result(), **local}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> "PendingRound | None":
        for what in ("delta", "point"):
            if f"pending_{what}" in state:
                local = state.get("pending_local_delta")
                return cls.ready(what, state[f"pending_{what}"].to(device, copy=True),
                                 None if local is None else local.to(device, copy=True))
        return None


class OuterState:
    """``theta0`` and ``y_prev`` for each parameter, on the parameters' device or in host memory.

    In host memory (``on_cpu``) each tensor is copied to the device for the outer step only, so
    the accelerator holds the model and the inner optimizer state but no outer copies.
    """

    def __init__(self, params: list[torch.Tensor], names: list[str], on_cpu: bool):
        self.names = names
        pin = on_cpu and torch.cuda.is_available() and any(p.is_cuda for p in params)

        def copy(p: torch.Tensor) -> torch.Tensor:
            if not on_cpu:
                return p.detach().clone()
            return pinned_zeros(p.shape, p.dtype, pin).copy_(p.detach())

        self.anchor = [copy(p) for p in params]
        self.y_prev = [copy(p) for p in params]   # y_{-1} := theta_0

    @classmethod
    def of(cls, names: list[str], anchor: list[torch.Tensor], y_prev: list[torch.Tensor]
           ) -> "OuterState":
        """One outer state over tensors held elsewhere (Streaming DiLoCo's fragments')."""
        state = cls.__new__(cls)
        state.names, state.anchor, state.y_prev = names, anchor, y_prev
        return state

    @staticmethod
    def on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t if t.device == device else t.to(device, non_blocking=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("anchor", "y_prev"):
            saved = state[key]
            missing = [n for n in self.names if n not in saved]
            if missing:
                raise KeyError(f"outer state {key!r} lacks parameters {missing[:5]}: it was saved "
                               "from another model")
            for n, t in zip(self.names, getattr(self, key)):
                t.copy_(saved[n])


class OuterAlgorithm(abc.ABC):
    """One outer round over the live ``params``: ``round(t)`` returns scalar metrics."""

    #: a committed blocking round leaves every parameter at its anchor (theta == theta0), so a
    #: checkpoint there needs no copy of theta; Streaming DiLoCo's round sets one fragment only
    round_sets_every_param: bool = True

    def __init__(self, params: list[torch.Tensor], names: list[str], comm: Comm, eta: float,
                 gamma: float, on_cpu: bool):
        if len({p.dtype for p in params}) != 1:
            raise ValueError("local strategies need every parameter in one dtype (the exchange "
                             f"sends one flat buffer); got {sorted({str(p.dtype) for p in params})}")
        self.params, self.comm, self.eta, self.gamma = params, comm, eta, gamma
        self.state = OuterState(params, names, on_cpu)

    @abc.abstractmethod
    def round(self, t: int) -> dict[str, float]:
        """Exchange and outer update for round ``t`` (DiLoCo: all-reduce; GASLoC: gossip)."""

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Outer state beyond ``theta0`` and ``y_prev`` that this worker alone holds (saved per
        rank with them; none here)."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        """Load what :meth:`extra_state` saved (``state``: the checkpoint's outer dict)."""

    def flat_like(self) -> torch.Tensor:
        p0 = self.params[0]
        return torch.empty(sum(p.numel() for p in self.params), dtype=p0.dtype, device=p0.device)

    def drift_flat(self) -> torch.Tensor:
        """``theta0 - theta`` of every parameter, in one new flat buffer."""
        st, dev = self.state, self.params[0].device
        out = self.flat_like()
        offset = 0
        with torch.no_grad():
            for p, anchor in zip(self.params, st.anchor):
                out[offset:offset + p.numel()].view_as(p).copy_(st.on(anchor, dev) - p)
                offset += p.numel()
        return out

    def set_params(self, flat: torch.Tensor, local_weight: float = 0.0,
                   local_delta: torch.Tensor | None = None) -> None:
        """theta0 <- flat, and theta <- flat (the next round starts where this one landed); or,
        for an overlapped round landing (see ``strategy.py``), with ``local_weight`` alpha > 0
        theta <- alpha * theta + (1 - alpha) * flat, and given this worker's own ``local_delta``
        of the round (``carry``) theta moves by what the round's end point moved,
        theta <- theta + flat - (theta0 - local_delta): the inner steps taken while the
        exchange ran are kept in part, or whole."""
        st, dev = self.state, self.params[0].device
        offset = 0
        with torch.no_grad():
            for p, anchor in zip(self.params, st.anchor):
                view = flat[offset:offset + p.numel()].view_as(p)
                if local_delta is not None:   # the round's end point was theta0 - local_delta
                    p.add_(view - st.on(anchor, dev)
                           + local_delta[offset:offset + p.numel()].view_as(p))
                elif local_weight:
                    p.lerp_(view, 1.0 - local_weight)
                else:
                    p.copy_(view)
                anchor.copy_(view)   # blocking: a host copy is read (snapshots) at once
                offset += p.numel()

    # -- an overlapped round: started at the round's end, landed tau inner steps later -------
    def start_round(self, t: int, keep_local: bool) -> tuple[PendingRound, dict[str, float]]:
        """Round ``t``'s exchange, started and not waited for; returns it and the round's
        metrics. An all-reduce round (DiLoCo, complete-graph GASLoC) here; gossip overrides."""
        delta, handle, drift, local = self.start_all_reduce(self.all_reduce_kind, async_op=True,
                                                            keep_local=keep_local)
        return PendingRound("delta", handle, lambda: delta, local), self.round_metrics(drift, True)

    def land(self, pending: PendingRound, local_weight: float) -> None:
        """The outer step of an overlapped round whose exchange is ``pending``."""
        if pending.what != "delta":
            raise ValueError(f"an all-reduce round lands an averaged delta, not a {pending.what}")
        self.apply_all_reduce(pending.result(), local_weight, pending.local)

    # -- DiLoCo's round (and complete-graph GASLoC's), whole or in two halves ---------------
    all_reduce_kind: str | None = None   # the Comm kind of an all-reduce round; None: no such round

    def round_metrics(self, drift: float, committed: bool) -> dict[str, float]:
        return {"outer/drift_norm": drift, "outer/committed": float(committed)}

    def start_all_reduce(self, kind: str, async_op: bool = False, keep_local: bool = False
                         ) -> tuple[torch.Tensor, Handle, float, torch.Tensor | None]:
        """``delta = theta0 - theta`` into one flat buffer and its average over the workers
        started (``async_op``: not waited for; the buffer must be left alone until it is).
        Returns (delta, its handle, this worker's drift norm ``||theta0 - theta||`` before the
        average, and with ``keep_local`` a copy of this worker's own delta)."""
        delta = self.drift_flat()
        with torch.no_grad():
            drift = float(torch.linalg.vector_norm(delta))
            local = delta.clone() if keep_local else None
        return delta, self.average(delta, kind, async_op), drift, local

    def average(self, delta: torch.Tensor, kind: str, async_op: bool) -> Handle:
        """``delta`` replaced by its mean over the workers (``Comm`` kind ``kind``): one fp32
        all-reduce here; DiLoCo's quantized one where its outer gradients are coded."""
        return self.comm.all_reduce(delta, kind=kind, average=True, async_op=async_op)

    def apply_all_reduce(self, delta: torch.Tensor, local_weight: float = 0.0,
                         local_delta: torch.Tensor | None = None) -> bool:
        """The outer step from the averaged ``delta`` (its all-reduce waited for):
        ``y = theta0 - eta * delta``, ``x = y + gamma * (y - y_prev)``, ``y_prev <- y``,
        ``theta0 <- x``, and theta as :meth:`set_params` says; or, given this worker's own
        ``local_delta`` of the round (an overlapped round landing with ``carry``), theta moves by
        what the outer step moved its end point: ``theta += x - (theta0 - local_delta)``, so the
        inner steps taken since stay whole. Returns whether the round committed
        (``Comm.commit``): a round that does not is applied by nobody, so theta, theta0 and
        y_prev stay as they were and this worker's drift since the last committed round joins
        the next one."""
        if not self.comm.commit():
            return False
        st, dev = self.state, self.params[0].device
        with torch.no_grad():
            out = delta  # overwritten piecewise with the new outer point x
            offset = 0
            for p, anchor, y_prev in zip(self.params, st.anchor, st.y_prev):
                sl = slice(offset, offset + p.numel())
                y = outer_point(st.on(anchor, dev), delta[sl].view_as(p), self.eta)
                x = extrapolate(y, st.on(y_prev, dev), self.gamma)
                y_prev.copy_(y)
                out[sl].view_as(p).copy_(x)
                offset += p.numel()
            self.set_params(out, local_weight, local_delta)
        return True

    def all_reduce_round(self, kind: str) -> tuple[float, bool]:
        """DiLoCo's round: ``delta = all_reduce_avg(theta0 - theta)`` (``Comm`` kind ``kind``), then
        the outer step (:meth:`apply_all_reduce`), the same on every worker. Returns this
        worker's drift norm and whether the round committed."""
        delta, _, drift, _ = self.start_all_reduce(kind)
        return drift, self.apply_all_reduce(delta)
