"""GASLoC's mixing matrices: symmetric, doubly stochastic, the graph shapes the spec names, and a
pure function of (seed, round). Identity across real processes is checked in test_gasloc.py."""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.local.topology import (TOPOLOGIES, exchange_phases, mixing_matrix, peers,
                                              permutation)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
def test_symmetric_doubly_stochastic_nonnegative(topology, n):
    for t in range(12):
        w = mixing_matrix(topology, n, t, seed=3)
        assert w.shape == (n, n) and w.dtype == torch.float64
        assert torch.equal(w, w.T)
        assert torch.allclose(w.sum(0), torch.ones(n, dtype=torch.float64), atol=1e-15, rtol=0)
        assert torch.allclose(w.sum(1), torch.ones(n, dtype=torch.float64), atol=1e-15, rtol=0)
        assert (w >= 0).all()


def test_complete_is_uniform():
    assert torch.equal(mixing_matrix("complete", 4, 7, 0), torch.full((4, 4), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("n", [2, 4, 5, 8, 9])
def test_one_peer_is_disjoint_pairs_and_odd_leftover_keeps_itself(n):
    for t in range(10):
        w = mixing_matrix("1peer", n, t, seed=1)
        pi = permutation(n, t, 1)
        lonely = [i for i in range(n) if not peers(w, i)]
        for i in range(n):
            nbrs = peers(w, i)
            assert len(nbrs) <= 1
            if nbrs:
                j = nbrs[0]
                assert peers(w, j) == [i]                 # pairs are disjoint
                assert w[i, i] == w[i, j] == 0.5
                assert abs(pi.index(i) - pi.index(j)) == 1 and min(pi.index(i), pi.index(j)) % 2 == 0
        if n % 2:
            assert lonely == [pi[-1]] and w[pi[-1], pi[-1]] == 1.0
        else:
            assert lonely == []


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_two_peer_is_the_permuted_ring(n):
    for t in range(10):
        w = mixing_matrix("2peer", n, t, seed=2)
        pi = permutation(n, t, 2)
        for k in range(n):
            i, prev, nxt = pi[k], pi[k - 1], pi[(k + 1) % n]
            assert peers(w, i) == sorted({prev, nxt})
            assert w[i, i] == w[i, prev] == w[i, nxt] == 1.0 / 3.0


def test_two_peer_with_two_workers_is_a_pair():
    for t in range(5):
        w = mixing_matrix("2peer", 2, t, seed=0)
        assert torch.equal(w, torch.full((2, 2), 0.5, dtype=torch.float64))


def test_graph_is_a_pure_function_of_seed_and_round_and_changes_over_rounds():
    a = [mixing_matrix("2peer", 8, t, seed=5) for t in range(6)]
    b = [mixing_matrix("2peer", 8, t, seed=5) for t in range(6)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len({tuple(permutation(8, t, 5)) for t in range(6)}) > 1      # random per round
    assert any(permutation(8, t, 5) != permutation(8, t, 6) for t in range(6))  # seed matters
    assert sorted(permutation(8, 3, 5)) == list(range(8))


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
def test_exchange_phases_are_permutations_covering_each_peer_once(topology, n):
    """In each phase every worker sends to at most one peer and the receiver expects exactly
    that sender (one flow per link and direction); over the phases each worker sends to and
    receives from each of its peers in W_t once."""
    for t in range(8):
        w = mixing_matrix(topology, n, t, seed=4)
        phases = {i: exchange_phases(topology, n, t, 4, i) for i in range(n)}
        for i in range(n):
            assert sorted(dst for dst, _ in phases[i]) == peers(w, i)
            assert sorted(src for _, src in phases[i]) == peers(w, i)
            for p, (dst, src) in enumerate(phases[i]):
                assert phases[dst][p][1] == i          # the receiver expects this sender then
                assert phases[src][p][0] == i
        if topology == "2peer" and n >= 3:
            assert {len(ph) for ph in phases.values()} == {2}


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown topology"):
        mixing_matrix("ring", 4, 0, 0)
    with pytest.raises(ValueError, match="unknown topology"):
        exchange_phases("ring", 4, 0, 0, 0)
    with pytest.raises(ValueError, match="at least one worker"):
        mixing_matrix("2peer", 0, 0, 0)
    with pytest.raises(ValueError, match="seed and round"):
        permutation(4, 0, -1)
