"""GASLoC's outer step: local Nesterov extrapolation, then one gossip exchange with the peers.

Spec (/work/shared/spec/gasloc.md), for worker i in round t:

    g   = theta - theta0                     local drift (zero for a worker with H_i = 0)
    y   = theta0 + eta * g
    x   = y + gamma * (y - y_prev);  y_prev <- y
    theta <- sum_j W_t[i, j] x_j             point-to-point with the peers of W_t (but see below)

``mix_momentum=False`` (ablation) mixes ``y`` and adds ``gamma * (y - y_prev)`` afterwards. The
mixed sum runs over j in ascending rank order on every worker.

The complete graph (``W = 11^T / n``, with ``mix_momentum``) is DiLoCo: there the round is
DiLoCo's own code, ``OuterAlgorithm.all_reduce_round`` (the drift all-reduced and divided by n,
counted as kind ``gossip``), so the parameters equal DiLoCo's bit for bit for every n and any
data, not only algebraically (see ``outer.py`` for why mixing ``x`` would not). It is the same
update as the spec's: ``theta = mean_j x_j = (1 + gamma) mean_j y_j - gamma mean_j y_prev_j``
depends on ``y_prev`` only through its mean, and this path keeps ``y_prev`` = that mean, the same
on every worker (the spec's local ``y_prev_i`` differ when the workers' data differ). It is the
one GASLoC round that runs a collective: on the complete graph every worker is every worker's
peer, and a ring all-reduce of the drift sends ``2 (n - 1) / n`` models per worker where a
point-to-point mix would send ``n - 1``.
"""

from __future__ import annotations

import torch

from scape_train.comm import Comm, Handle
from .outer import OuterAlgorithm, PendingRound, extrapolate, outer_point
from .topology import exchange_phases, mixing_matrix


class GASLoC(OuterAlgorithm):
    def __init__(self, params: list[torch.Tensor], names: list[str], comm: Comm, eta: float,
                 gamma: float, on_cpu: bool, topology: str, seed: int, mix_momentum: bool = True):
        super().__init__(params, names, comm, eta, gamma, on_cpu)
        self.topology, self.seed, self.mix_momentum = topology, seed, mix_momentum
        # the complete graph's round is DiLoCo's all-reduce (below); sparse graphs gossip
        self.all_reduce_kind = "gossip" if topology == "complete" and mix_momentum else None

    def round_metrics(self, drift: float, committed: bool) -> dict[str, float]:
        return {**super().round_metrics(drift, committed),
                "outer/peers": float(self.comm.world - 1)}

    def _local_points(self) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """(what is sent: x, or y for the ablation; the ablation's momentum term; drift norm).
        ``y_prev`` is left as it is: :meth:`_advance` moves it once the round commits."""
        st, dev = self.state, self.params[0].device
        send = self.flat_like()
        momentum = None if self.mix_momentum else self.flat_like()
        drift_sq = torch.zeros((), dtype=torch.float64, device=dev)   # one host sync, not one per tensor
        offset = 0
        for p, anchor, y_prev in zip(self.params, st.anchor, st.y_prev):
            sl = slice(offset, offset + p.numel())
            a = st.on(anchor, dev)
            delta = a - p                          # = -g
            drift_sq += torch.linalg.vector_norm(delta, dtype=torch.float64) ** 2
            y = outer_point(a, delta, self.eta)    # theta0 + eta * g
            yp = st.on(y_prev, dev)
            if self.mix_momentum:
                send[sl].view_as(p).copy_(extrapolate(y, yp, self.gamma))
            else:
                send[sl].view_as(p).copy_(y)
                torch.mul(y - yp, self.gamma, out=momentum[sl].view_as(p))
            offset += p.numel()
        return send, momentum, float(drift_sq) ** 0.5

    def _advance(self) -> None:
        """``y_prev <- y`` of this round, recomputed from theta0 and theta (both unchanged since
        :meth:`_local_points`, by the same ops: the same bits)."""
        st, dev = self.state, self.params[0].device
        for p, anchor, y_prev in zip(self.params, st.anchor, st.y_prev):
            a = st.on(anchor, dev)
            y_prev.copy_(outer_point(a, a - p, self.eta))

    def start_mix(self, send: torch.Tensor, t: int, async_op: bool = False
                  ) -> tuple[dict[int, torch.Tensor], Handle, int]:
        """Round ``t``'s exchange with this worker's peers of ``W_t``, started (``async_op``: not
        waited for; ``send`` must be left alone until it is). Returns (the peers' buffers, by
        rank; the exchange's handle; the number of peers)."""
        phases = exchange_phases(self.topology, self.comm.world, t, self.seed, self.comm.rank)
        bufs = {src: torch.empty_like(send) for _, src in phases}
        handle = self.comm.exchange([([(send, dst)], [(bufs[src], src)]) for dst, src in phases],
                                    kind="gossip", async_op=async_op)
        return bufs, handle, len(bufs)

    def mixed(self, send: torch.Tensor, bufs: dict[int, torch.Tensor], t: int) -> torch.Tensor:
        """``sum_j W_t[i, j] send_j`` over this worker and its peers (their exchange landed)."""
        rank = self.comm.rank
        w = mixing_matrix(self.topology, self.comm.world, t, self.seed)
        out: torch.Tensor | None = None
        for j in sorted([*bufs, rank]):         # one fixed order on every worker
            src, wij = (send if j == rank else bufs[j]), float(w[rank, j])
            if out is None:
                out = src * wij
            else:
                out.add_(src, alpha=wij)
        return out

    def mix(self, send: torch.Tensor, t: int) -> tuple[torch.Tensor, int]:
        """``sum_j W_t[i, j] send_j`` over this worker's peers; returns (mixed, number of peers)."""
        bufs, _, n_peers = self.start_mix(send, t)
        return self.mixed(send, bufs, t), n_peers

    def round(self, t: int) -> dict[str, float]:
        if self.all_reduce_kind is not None:   # the complete graph: DiLoCo, bit for bit
            return self.round_metrics(*self.all_reduce_round(kind=self.all_reduce_kind))
        with torch.no_grad():
            send, momentum, drift = self._local_points()
            mixed, n_peers = self.mix(send, t)
            committed = self.comm.commit()   # a round nobody applies leaves y_prev and theta alone
            if committed:
                self._advance()
                if momentum is not None:
                    mixed.add_(momentum)
                self.set_params(mixed)
        return {"outer/drift_norm": drift, "outer/peers": float(n_peers),
                "outer/committed": float(committed)}

    # -- an overlapped gossip round ------------------------------------------------------------
    def start_round(self, t: int, keep_local: bool) -> tuple[PendingRound, dict[str, float]]:
        """The gossip round's local points and exchange, started; it lands (:meth:`land`) as the
        mixed point ``sum_j W_t[i, j] x_j`` (+ the ablation's momentum term), computed once.
        ``y_prev`` moves now, while theta is still the round's end point: an overlapped round
        always commits (static groups only: elastic runs refuse ``overlap_steps``)."""
        if self.all_reduce_kind is not None:
            return super().start_round(t, keep_local)
        with torch.no_grad():
            send, momentum, drift = self._local_points()
            # carry: the round's end point is theta0 - local
            local = self.drift_flat() if keep_local else None
            self._advance()
            bufs, handle, n_peers = self.start_mix(send, t, async_op=True)

        def finish() -> torch.Tensor:
            with torch.no_grad():
                out = self.mixed(send, bufs, t)
                return out if momentum is None else out.add_(momentum)

        metrics = {"outer/drift_norm": drift, "outer/peers": float(n_peers), "outer/committed": 1.0}
        return PendingRound("point", handle, finish, local), metrics

    def land(self, pending: PendingRound, local_weight: float) -> None:
        if pending.what != "point":
            return super().land(pending, local_weight)
        point = pending.result()
        if not self.comm.commit():
            raise RuntimeError("an overlapped gossip round did not commit: overlapped rounds run "
                               "on static groups only (strategy.elastic refuses overlap_steps)")
        self.set_params(point, local_weight, pending.local)
