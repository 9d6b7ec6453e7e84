"""Gossip graphs: who sends to whom, and with which mixing weights.

Two families, both circulant (rank r's neighbours are r plus fixed offsets
mod n), so every node has the same degree and uniform weights give a doubly
stochastic mixing matrix:

* **Directed exponential graph, time-varying** (SGP; Assran et al. 2019,
  "Stochastic Gradient Push for Distributed Deep Learning", Sec. 5): the
  offsets are 2^0, 2^1, ..., 2^floor(log2(n - 1)) (all distinct and < n, so
  any n >= 2 works, 3 included); at round t a node with ``peers`` = k
  out-neighbours per round sends to r + o for the k offsets
  ``offsets[(t*k + j) mod L]``, j < k, cycling through them, and receives
  from r - o for the same offsets. Mixing: uniform 1/(k + 1) over itself and
  its out-neighbours (column stochastic; regular here, so also row
  stochastic). The reference implementation's phone book also lists the
  backward peers r - 2^i; the issue's graph (forward only) is used here.
* **Static undirected graphs** (D-PSGD, CHOCO-SGD): ``ring`` (r +- 1),
  ``exponential`` (r +- 2^i, the same offsets), ``complete``; weights
  1/(deg + 1) for itself and each neighbour: symmetric, doubly stochastic
  (a ring of n >= 4 gets 1/3, as in Lian et al. 2017).

Everything here is pure Python on rank numbers (and float64 matrices for
tests and docs): the algorithms and the tests derive the same graph.
"""

from __future__ import annotations

import torch

__all__ = ["TOPOLOGIES", "exponential_offsets", "sgp_offsets", "sgp_peers", "neighbors", "self_weight",
           "sgp_matrix", "mixing_matrix", "spectral_gap"]

#: the static undirected graphs of D-PSGD and CHOCO-SGD
TOPOLOGIES = ("ring", "exponential", "complete")


def exponential_offsets(n: int) -> list[int]:
    """2^i for i = 0 .. floor(log2(n - 1)): the hop distances of the
    exponential graph on ``n`` nodes (empty for n < 2)."""
    if n < 2:
        return []
    return [1 << i for i in range((n - 1).bit_length())]


def sgp_offsets(step: int, n: int, peers: int) -> list[int]:
    """The offsets every node uses at round ``step``: ``peers`` consecutive
    entries of :func:`exponential_offsets`, cycling."""
    offs = exponential_offsets(n)
    if not offs:
        return []
    if not 1 <= peers <= len(offs):
        raise ValueError(f"peers must be between 1 and {len(offs)} on {n} nodes, got {peers}")
    return [offs[(step * peers + j) % len(offs)] for j in range(peers)]


def sgp_peers(rank: int, n: int, step: int, peers: int) -> tuple[list[int], list[int]]:
    """(out-peers, in-peers) of ``rank`` at round ``step``, in offset order."""
    offs = sgp_offsets(step, n, peers)
    return [(rank + o) % n for o in offs], [(rank - o) % n for o in offs]


def neighbors(kind: str, rank: int, n: int) -> list[int]:
    """The distinct neighbours of ``rank`` in the undirected graph ``kind``, sorted."""
    if kind not in TOPOLOGIES:
        raise ValueError(f"unknown topology {kind!r}; allowed: {', '.join(TOPOLOGIES)}")
    if kind == "complete":
        offs = list(range(1, n))
    elif kind == "ring":
        offs = [1, -1]
    else:
        offs = [s * o for o in exponential_offsets(n) for s in (1, -1)]
    return sorted({(rank + o) % n for o in offs} - {rank})


def self_weight(kind: str, n: int) -> float:
    """The uniform weight 1/(deg + 1) every node gives itself and each neighbour."""
    return 1.0 / (len(neighbors(kind, 0, n)) + 1)


def mixing_matrix(kind: str, n: int) -> torch.Tensor:
    """W (float64, n x n) of the undirected graph ``kind``: W[i, j] = weight
    node i gives node j's value."""
    w = torch.zeros(n, n, dtype=torch.float64)
    a = self_weight(kind, n)
    for i in range(n):
        w[i, i] = a
        for j in neighbors(kind, i, n):
            w[i, j] = a
    return w


def sgp_matrix(n: int, step: int, peers: int) -> torch.Tensor:
    """P_t (float64, n x n, column stochastic) of SGP's round ``step``:
    P[dst, src] is the share of src's (x, w) that dst receives."""
    p = torch.zeros(n, n, dtype=torch.float64)
    a = 1.0 / (peers + 1)
    for src in range(n):
        p[src, src] += a
        for dst in sgp_peers(src, n, step, peers)[0]:
            p[dst, src] += a
    return p


def spectral_gap(w: torch.Tensor) -> float:
    """1 - |lambda_2| of a symmetric mixing matrix: how fast gossip on it
    contracts the consensus distance (1 for exact averaging)."""
    eig = torch.linalg.eigvalsh(w).abs().sort(descending=True).values
    return float(1.0 - eig[1]) if eig.numel() > 1 else 1.0
