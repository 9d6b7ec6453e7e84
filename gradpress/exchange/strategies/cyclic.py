"""``cyclic``: one shared support per call, chosen by a leader that cycles
over the ranks (ScaleCom's cyclic local top-k, CLT-k: Chen et al., NeurIPS
2020, "ScaleCom: Scalable Sparsified Gradient Compression for
Communication-Efficient Distributed Training").

At call step t the leader is rank ``t mod N``. It runs the compressor, a
sparsifier whose packet is ``[values, integer flat indices]`` with exact
values (``topk``, ``threshold``), on its error-compensated tensors
and broadcasts the indices. Every rank then takes its own values at those
indices, and one allreduce sums them. Each kept coordinate is the exact
average over all ranks (each rank's values are scaled by 1/N before the
sum, so values near the dtype's maximum do not overflow). In ``allgather``, by contrast, N supports are
averaged: a coordinate that only one rank kept gets that rank's share
(1/N of its value), and the other ranks' values there wait in their
residuals. In the DDP hook every bucket of a step has the same leader. The support is the
leader's local top-k, so a coordinate large on average but small on the
leader waits for another leader. ScaleCom shows the leaders' supports agree
closely when the residuals are kept (its "commonality"); error feedback is
the price, and with it each rank keeps everything off the support. If the
leader's compressor raises, every rank raises (the leader its own error,
the others an error naming the leader) instead of waiting on it.

The support is identical on every rank and the values are summed by one
allreduce, so the results are bit-identical on every rank. It is also
summable: the sum of the payloads is the payload of the sum, so nothing is
gathered N times. Per rank and call, ``k`` values go in the allreduce; the
leader broadcasts ``k`` indices (int32 below 2^31 elements) and the counts
(int64, one per tensor), and the broadcast's bytes are counted on the leader.

Only the leader runs the compressor, so its per-tensor state would exist on
one rank in N. Stateful compressors are refused for that reason: the
threshold estimators (``dgc_threshold``, ``sidco``, ``gaussiank``,
``redsync``) keep state. Compressors without exact values are refused too,
because what they send is not the input on a support. ``randomk`` already
shares its support through the shared seed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradpress.compress.base import Compressor, Context
from gradpress.exchange.base import ExchangeResult, Prelude, Strategy, register_strategy
from gradpress.exchange.costs import CostModel
from gradpress.exchange.feedback import Feedback
from gradpress.exchange.strategies.support import mean_on_support, sparsifier_refusal
from gradpress.transport.p2p import global_rank


@register_strategy("cyclic")
class Cyclic(Strategy):
    order = 5
    planned = False  # a different estimator, not a faster way to move the same one: the user opts in

    def supports(self, compressor: Compressor) -> str | None:
        reason = sparsifier_refusal(compressor, "it shares one rank's support", "topk, threshold")
        if reason:
            return reason
        if compressor.stateful:
            return f"cyclic runs the compressor on one rank per call; {compressor.name!r} keeps per-tensor state"
        return None

    @classmethod
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool, *,
                elem_size: int = 4) -> tuple[float, int]:
        """``ENC(d) + BC(c(d) / 2) + AR(c(d) / 2)``: half of a value-index
        packet travels as indices, half as values."""
        d = float(numel)
        half = costs.wire(d) / 2
        return costs.encode(d) + costs.broadcast(half) + costs.allreduce(half), 1

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
    ) -> ExchangeResult:
        t0 = time.perf_counter()
        leader = ctxs[0].step % self.world_size if ctxs else 0
        flats = [t.reshape(-1) for t in tensors]
        device = flats[0].device if flats else torch.device("cpu")
        wide = any(f.numel() >= 2**31 for f in flats)
        index_dtype = torch.int64 if wide else torch.int32
        chosen: list[torch.Tensor] = []
        failure: BaseException | None = None
        if self.rank == leader:
            try:
                chosen = [compressor.encode(t, c).tensors[1].reshape(-1).to(index_dtype) for t, c in zip(tensors, ctxs)]
            except Exception as exc:  # noqa: BLE001 - told to every rank below, then re-raised here
                failure, chosen = exc, []
        # one count per tensor; -1 everywhere: the leader failed (every rank raises instead of waiting on it)
        counts = torch.tensor([c.numel() for c in chosen] if failure is None and self.rank == leader
                              else [-1] * len(flats), dtype=torch.int64).to(device)
        t1 = time.perf_counter()
        sent = 0
        src = global_rank(self.group, leader)
        if self.world_size > 1:
            dist.broadcast(counts, src, group=self.group)
        sizes = [int(n) for n in counts.tolist()]
        if any(n < 0 for n in sizes):
            if failure is not None:
                raise failure
            raise RuntimeError(f"strategy 'cyclic': the leader of step {ctxs[0].step}, rank {leader}, failed to "
                               f"select the support of {ctxs[0].key!r} and the other tensors of this call; its own "
                               "error says why")
        if self.rank == leader:
            indices = torch.cat(chosen) if chosen else torch.zeros(0, dtype=index_dtype, device=device)
            sent += counts.numel() * 8 + indices.numel() * indices.element_size()
        else:
            indices = torch.empty(sum(sizes), dtype=index_dtype, device=device)
        if self.world_size > 1 and indices.numel():
            dist.broadcast(indices, src, group=self.group)
        support = [idx.long() for idx in indices.split(sizes)] if sizes else []
        t2 = time.perf_counter()
        results, residuals, value_bytes, nbytes, allreduce_s = mean_on_support(
            tensors, flats, support, self.group, self.world_size, out, feedback is not None)
        sent += nbytes
        tensor_bytes = [v + (idx.numel() * indices.element_size() if self.rank == leader else 0)
                        for v, idx in zip(value_bytes, support)]
        compress_s = (t1 - t0) + (time.perf_counter() - t2 - allreduce_s)
        return ExchangeResult(results, sent, residuals, tensor_bytes, compress_s, (t2 - t1) + allreduce_s)
