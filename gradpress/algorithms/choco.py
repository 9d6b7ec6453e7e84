"""``choco:gamma=0.5,topology=ring``: CHOCO-SGD, decentralized SGD with
compressed gossip (default compressor: ``efsignsgd``, scaled sign).

Koloskova, Stich, Jaggi 2019, "Decentralized Stochastic Optimization and
Gossip Algorithms with Compressed Communication" (ICML), Algorithm 2. Node i
keeps its model x_i and the *public copies* x^_j of itself and of its
neighbours (every holder of x^_j keeps the same value). One step, on the
static undirected graph ``topology`` with symmetric doubly stochastic W
(:mod:`gradpress.algorithms.topology`):

    x_i <- x_i + (optimizer step)                   # x - lr * g(x) for SGD
    q_i = Q(x_i - x^_i); send q_i to every neighbour
    x^_j <- x^_j + q_j for j = i and every neighbour
    x_i <- x_i + gamma * sum_j w_ij (x^_j - x^_i)

What Q drops stays in x_i - x^_i and is sent later: the public copies are
the error feedback (no separate residual; ``error_feedback=False`` is
refused). As in the authors' code, a node does not store each neighbour's
copy but s_i = sum_j w_ij x^_j (itself included), updated by w_ij D(q_j):
two model-sized copies per node. Choices where the paper is silent or
differs: the copies start at the common x_0 (every rank starts from rank
0's parameters, so every node knows them; the paper starts at 0, which only
delays the first steps), and Q is applied per tensor, with the tensors the
plan leaves uncompressed (1-D, below ``min_numel``) gossiped exactly.

Q must be contractive (see :mod:`gradpress.algorithms.gossip_codec` for the
accepted compressors; an unbiased one is used as Q/(1 + omega)). The
consensus step gamma must shrink with the compression (the paper tunes it).
Measured on mnist1d-cnn, 4 workers, ring (docs/gossip.md): scaled sign
(``efsignsgd``, the default, as in the authors' example scripts) trains
with gamma = 0.5, top-k 10% with 0.2, top-k 1% with 0.1 (0.2 diverged).

Invariants: the average over nodes of x moves only by the optimizer steps
(W is doubly stochastic: sum_i sum_j w_ij (x^_j - x^_i) = 0), and with the
identity compressor and gamma = 1 a step is exactly
x_i <- sum_j w_ij (x_j - lr g_j): D-PSGD in its adapt-then-combine form (the
test checks both in float64 against its own reference).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradpress.algorithms.gossip import GossipAlgorithm, Posted
from gradpress.algorithms.registry import register
from gradpress.algorithms.topology import TOPOLOGIES, neighbors, self_weight
from gradpress.compress.base import Param


def topology_param(default: str = "ring") -> Param:
    return Param("topology", str, default, " | ".join(TOPOLOGIES), lambda v: v in TOPOLOGIES,
                 "static undirected graph; uniform weights 1/(degree + 1)")


@register
class Choco(GossipAlgorithm):
    name = "choco"
    PARAMS = (
        Param("gamma", float, 0.5, "0 < gamma <= 1", lambda v: 0 < v <= 1, "consensus step size"),
        topology_param(),
    )
    default_compressor = "efsignsgd"
    summary = ("CHOCO-SGD (Koloskova et al. 2019): compressed gossip of Q(x - x^) on a static graph, "
               "public copies x^ as the error feedback, consensus step gamma")

    def setup_gossip(self) -> None:
        self.peers_list = neighbors(self.topology, self.rank, self.world_size)  # type: ignore[attr-defined]
        self.w_self = self_weight(self.topology, self.world_size)  # type: ignore[attr-defined]

    def init_state(self) -> None:
        with torch.no_grad():
            self.hat = [p.detach().clone() if c else None for p, c in zip(self.params, self.codec.compressed)]
            self.mix = [p.detach().clone() if c else None for p, c in zip(self.params, self.codec.compressed)]

    def step(self) -> None:
        self.local_step()
        if self.world_size == 1:
            return
        t = self._steps - 1
        with torch.no_grad():
            t0 = self.clock()
            params = [p.detach() for p in self.params]
            msg = [p - h if h is not None else p for p, h in zip(params, self.hat)]
            buf, packets = self.codec.encode(msg, t)
            for i, (h, s) in enumerate(zip(self.hat, self.mix)):
                if h is not None:
                    d = self.codec.decode_one(i, packets[i])
                    h.add_(d)
                    s.add_(d, alpha=self.w_self)  # type: ignore[union-attr]
            t1 = self.clock()
            posted = Posted(self, t, {j: buf for j in self.peers_list},
                            {j: self.expected_size(buf) for j in self.peers_list})
            got = posted.wait()
            posted.finish_sends()
            t2 = self.clock()
            # exact tensors: sum_j w_ij x_j - x_i as sum over neighbours of w_ij (x_j - x_i), exactly 0 where the
            # replicas agree (a parameter no rank trains stays bit for bit)
            exact = [torch.zeros_like(p) if h is None else None for p, h in zip(params, self.hat)]
            for j in self.peers_list:
                values, _ = self.codec.decode(got[j], packets)
                for i, v in enumerate(values):
                    if self.hat[i] is not None:
                        self.mix[i].add_(v, alpha=self.w_self)  # type: ignore[union-attr]
                    else:
                        exact[i].add_(v - params[i], alpha=self.w_self)  # type: ignore[union-attr]
            gamma = self.gamma  # type: ignore[attr-defined]
            for p, h, s, e in zip(params, self.hat, self.mix, exact):
                if h is not None:
                    p.add_(s - h, alpha=gamma)  # type: ignore[operator]
                else:
                    p.add_(e, alpha=gamma)  # type: ignore[arg-type]
            self.account(posted.sent, t1 - t0 + self.clock() - t2, t2 - t1,
                         self.payload_bytes(self.codec.keys, packets))

    def extra_state(self) -> dict[str, Any]:
        return {"hat": [h.clone() for h in self.hat if h is not None],
                "mix": [s.clone() for s in self.mix if s is not None]}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        mine = [h for h in self.hat if h is not None]
        if len(state.get("hat", [])) != len(mine) or len(state.get("mix", [])) != len(mine):
            raise ValueError("choco state: public copies missing or of another model/plan")
        for h, s in zip(mine, state["hat"]):
            h.copy_(s)
        for m, s in zip([m for m in self.mix if m is not None], state["mix"]):
            m.copy_(s)
