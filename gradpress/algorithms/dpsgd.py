"""``dpsgd:topology=ring``: decentralized parallel SGD (D-PSGD).

Lian, Zhang, Zhang, Hsieh, Zhang, Liu 2017, "Can Decentralized Algorithms
Outperform Centralized Algorithms? A Case Study for Decentralized Parallel
Stochastic Gradient Descent" (NeurIPS), Algorithm 1: node i computes its
stochastic gradient at x_i, averages its parameters with its neighbours on
a static undirected graph with symmetric doubly stochastic W, and applies
its own gradient:

    x_i <- sum_j w_ij x_j - lr * g_i(x_i)            (combine, then adapt)

The optimizer's step (momentum, Adam) stands for ``- lr * g``; it runs
while the parameters travel (sends and receives are posted first). Exact
parameters only: compressed gossip is :mod:`gradpress.algorithms.choco`
(with the identity compressor and gamma = 1 it is the adapt-then-combine
form x_i <- sum_j w_ij (x_j - lr g_j)).

Invariant: gossip preserves the average over nodes of x (W is doubly
stochastic), and the consensus distance contracts by the second largest
eigenvalue of W per step (:func:`gradpress.algorithms.topology.spectral_gap`).
"""

from __future__ import annotations

import torch

from gradpress.algorithms.choco import topology_param
from gradpress.algorithms.gossip import GossipAlgorithm, Posted
from gradpress.algorithms.registry import register
from gradpress.algorithms.topology import neighbors, self_weight


@register
class DPSGD(GossipAlgorithm):
    name = "dpsgd"
    PARAMS = (topology_param(),)
    compresses = False
    summary = "D-PSGD (Lian et al. 2017): average exact parameters with graph neighbours, then the local step"

    def setup_gossip(self) -> None:
        self.peers_list = neighbors(self.topology, self.rank, self.world_size)  # type: ignore[attr-defined]
        self.w_self = self_weight(self.topology, self.world_size)  # type: ignore[attr-defined]

    def step(self) -> None:
        if self.world_size == 1:
            self.local_step()
            return
        t = self._steps
        with torch.no_grad():
            params = [p.detach() for p in self.params]
            buf, packets = self.codec.encode(params, t)  # a copy of x^t: the message and the local reference
            t0 = self.clock()
            posted = Posted(self, t, {j: buf for j in self.peers_list},
                            {j: self.expected_size(buf) for j in self.peers_list})
            t1 = self.clock()
        self.local_step()  # overlaps the transfer
        with torch.no_grad():
            t2 = self.clock()
            got = posted.wait()
            posted.finish_sends()
            t3 = self.clock()
            own, _ = self.codec.decode(buf, packets)
            # sum_j w_ij x_j - x_i as sum over neighbours of w_ij (x_j - x_i): exactly 0 where the replicas agree
            # (a parameter no rank trains stays bit for bit; w_ij x_j summed would round it by an ulp per step)
            drift = [torch.zeros_like(x) for x in own]
            for j in self.peers_list:
                values, _ = self.codec.decode(got[j], packets)
                for d, v, x in zip(drift, values, own):
                    d.add_(v - x, alpha=self.w_self)
            for p, d in zip(params, drift):
                p.add_(d)  # sum_j w_ij x_j + (optimizer step)
            self.account(posted.sent, 0.0, (t1 - t0) + (t3 - t2), self.payload_bytes(self.codec.keys, packets))
