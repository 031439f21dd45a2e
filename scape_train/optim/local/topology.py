"""Gossip graphs for GASLoC: the mixing matrix ``W_t`` of round ``t`` and each worker's peers.

Every worker builds the same ``W_t`` without talking: the random permutation ``pi_t`` comes from
an RNG seeded by ``(seed, t)`` alone (numpy's SeedSequence, so it is the same on every platform).

    complete  W = 11^T / n                        (GASLoC on it runs DiLoCo's round: gasloc.py)
    1peer     disjoint pairs (pi(0),pi(1)), (pi(2),pi(3)), ... with weights 1/2; with odd n the
              leftover worker keeps itself (weight 1) that round
    2peer     the random ring pi(0) -> pi(1) -> ... -> pi(n-1) -> pi(0), weights 1/3 for self,
              previous and next; n = 2 degenerates to a pair (1/2), n = 1 to the identity

Each ``W_t`` is symmetric with rows summing to one (doubly stochastic), so a gossip step
``theta_i = sum_j W[i, j] x_j`` preserves the mean over workers.

The exchange runs in phases (:func:`exchange_phases`), each a permutation of the workers: in a
phase every worker sends to at most one peer and receives from at most one, so no two of its
flows share its link (2peer: forward round the ring, then backward).
"""

from __future__ import annotations

import numpy as np
import torch

TOPOLOGIES = ("complete", "1peer", "2peer")


def permutation(n: int, t: int, seed: int) -> list[int]:
    """The round-``t`` permutation ``pi_t`` of ``range(n)``; a pure function of (seed, t)."""
    if seed < 0 or t < 0:
        raise ValueError(f"seed and round must be >= 0, got seed={seed}, t={t}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, t]))
    return [int(i) for i in rng.permutation(n)]


def mixing_matrix(topology: str, n: int, t: int, seed: int) -> torch.Tensor:
    """``W_t`` (float64, n x n) for ``topology`` over ``n`` workers in round ``t``."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; valid: {list(TOPOLOGIES)}")
    if n < 1:
        raise ValueError(f"need at least one worker, got n={n}")
    if topology == "complete":
        return torch.full((n, n), 1.0 / n, dtype=torch.float64)
    w = torch.zeros(n, n, dtype=torch.float64)
    pi = permutation(n, t, seed)
    if topology == "1peer" or n == 2:
        for k in range(0, n - 1, 2):
            a, b = pi[k], pi[k + 1]
            w[a, a] = w[b, b] = w[a, b] = w[b, a] = 0.5
        if n % 2 == 1:
            w[pi[-1], pi[-1]] = 1.0
        return w
    if n == 1:
        w[0, 0] = 1.0
        return w
    for k in range(n):  # 2peer, n >= 3: previous, self and next are three distinct workers
        i, nxt = pi[k], pi[(k + 1) % n]
        w[i, i] = 1.0 / 3.0
        w[i, nxt] = w[nxt, i] = 1.0 / 3.0
    return w


def peers(w: torch.Tensor, rank: int) -> list[int]:
    """The workers ``rank`` exchanges with (both directions: ``W`` is symmetric), ascending."""
    return [j for j in range(w.shape[0]) if j != rank and w[rank, j] > 0]


def exchange_phases(topology: str, n: int, t: int, seed: int, rank: int) -> list[tuple[int, int]]:
    """Round ``t``'s exchange for worker ``rank`` as ``(send_to, receive_from)`` per phase, in
    order. Each phase is a permutation of the workers (its sends are everyone's receives), and
    over the phases ``rank`` sends to and receives from each of its peers in ``W_t`` once."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; valid: {list(TOPOLOGIES)}")
    if topology == "complete":   # shifts: phase s sends to rank + s, receives from rank - s
        return [((rank + s) % n, (rank - s) % n) for s in range(1, n)]
    pi = permutation(n, t, seed)
    k = pi.index(rank)
    if topology == "1peer" or n == 2:
        partner = k + 1 if k % 2 == 0 else k - 1
        return [(pi[partner], pi[partner])] if partner < n else []
    if n == 1:
        return []
    nxt, prev = pi[(k + 1) % n], pi[(k - 1) % n]
    return [(nxt, prev), (prev, nxt)]
