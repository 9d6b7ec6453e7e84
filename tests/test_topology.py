"""The gossip graphs of :mod:`gradpress.algorithms.topology` against their
definitions, rebuilt here: the exponential offsets 2^i < n, SGP's cycling
out-peers and the in-peers that mirror them, SGP's column-stochastic P_t,
the undirected graphs' uniform weights 1/(deg + 1), and the spectral gap of
a ring by its closed form (eigenvalues 1/3 + 2/3 cos(2 pi k / n))."""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.algorithms import topology

pytestmark = pytest.mark.mutants

NODES = range(1, 18)


def _offsets(n: int) -> list[int]:
    out, o = [], 1
    while o < n:
        out.append(o)
        o *= 2
    return out


def _neighbors(kind: str, i: int, n: int) -> set[int]:
    if kind == "complete":
        return set(range(n)) - {i}
    hops = [1] if kind == "ring" else _offsets(n)
    return {(i + s * o) % n for o in hops for s in (1, -1)} - {i}


@pytest.mark.parametrize("n", NODES)
def test_exponential_offsets_are_the_powers_of_two_below_n(n: int) -> None:
    assert topology.exponential_offsets(n) == (_offsets(n) if n >= 2 else [])


@pytest.mark.parametrize("n", NODES)
def test_sgp_peers_cycle_through_the_offsets_and_in_peers_mirror_out_peers(n: int) -> None:
    offs = _offsets(n)
    for peers in range(1, len(offs) + 1):
        for step in range(2 * len(offs) + 1):
            want = [offs[(step * peers + j) % len(offs)] for j in range(peers)]
            assert topology.sgp_offsets(step, n, peers) == want, (n, peers, step)
            for r in range(n):
                out, into = topology.sgp_peers(r, n, step, peers)
                assert out == [(r + o) % n for o in want]
                # the j-th in-peer is the node whose j-th out-peer is r
                assert [topology.sgp_peers(src, n, step, peers)[0][j] for j, src in enumerate(into)] == [r] * peers
    if n >= 2:
        with pytest.raises(ValueError, match=f"peers must be between 1 and {len(offs)} on {n} nodes, got 0"):
            topology.sgp_offsets(0, n, 0)


@pytest.mark.parametrize("n", range(2, 12))
def test_sgp_matrix_is_the_uniform_push_and_column_stochastic(n: int) -> None:
    offs = _offsets(n)
    for peers in (1, len(offs)):
        for step in range(3):
            want = torch.zeros(n, n, dtype=torch.float64)
            share = 1.0 / (peers + 1)
            for src in range(n):
                want[src, src] += share
                for j in range(peers):
                    want[(src + offs[(step * peers + j) % len(offs)]) % n, src] += share
            got = topology.sgp_matrix(n, step, peers)
            assert torch.allclose(got, want, rtol=0, atol=1e-15), (n, peers, step)
            assert torch.allclose(got.sum(0), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", topology.TOPOLOGIES)
@pytest.mark.parametrize("n", range(2, 12))
def test_mixing_matrix_gives_itself_and_each_neighbour_one_over_degree_plus_one(kind: str, n: int) -> None:
    w = topology.mixing_matrix(kind, n)
    for i in range(n):
        near = _neighbors(kind, i, n)
        assert topology.neighbors(kind, i, n) == sorted(near)
        for j in range(n):
            want = 1.0 / (len(near) + 1) if j == i or j in near else 0.0
            assert w[i, j].item() == pytest.approx(want, abs=1e-15), (kind, n, i, j)
    assert torch.equal(w, w.T)
    assert torch.allclose(w.sum(1), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert topology.self_weight(kind, n) == pytest.approx(1.0 / (len(_neighbors(kind, 0, n)) + 1), abs=1e-15)
    if kind == "ring" and n >= 4:
        assert topology.self_weight(kind, n) == pytest.approx(1 / 3)  # Lian et al. 2017


@pytest.mark.parametrize("n", range(4, 12))
def test_spectral_gap_of_a_ring_and_of_exact_averaging(n: int) -> None:
    """Circulant W of the ring: eigenvalues 1/3 + 2/3 cos(2 pi k / n); the
    complete graph averages exactly (W = J / n, gap 1)."""
    second = max(abs(1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / n)) for k in range(1, n))
    assert topology.spectral_gap(topology.mixing_matrix("ring", n)) == pytest.approx(1 - second, abs=1e-12)
    assert topology.spectral_gap(topology.mixing_matrix("complete", n)) == pytest.approx(1.0, abs=1e-12)
    assert topology.spectral_gap(torch.ones(1, 1, dtype=torch.float64)) == 1.0


def test_unknown_topology_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="unknown topology 'torus'; allowed: ring, exponential, complete"):
        topology.neighbors("torus", 0, 4)
