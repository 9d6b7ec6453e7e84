"""``union``: every rank's sparse support, merged; the exact average on the
union.

Each rank runs the compressor, a sparsifier whose packet is ``[values,
integer flat indices]`` with exact values (``topk``, ``threshold``), on its
error-compensated tensors, and the ranks gather each other's *indices* only.
Every rank forms the union of the N supports (sorted, so identical on every
rank), takes its own values there, and one allreduce sums them: each
coordinate of the union is the exact average over all ranks (values scaled
by 1/N before the sum, as ``allreduce`` scales its payloads, so N values near
the dtype's maximum do not overflow). This is the sparse allreduce over the
union of the local top-k supports (SparCML, Renggli et al., SC 2019,
"SparCML: High-Performance Sparse Communication for Machine Learning";
gTop-k's first phase, Shi et al., ICDCS 2019).

Against ``allgather`` (N supports averaged: a coordinate that one rank kept
gets that rank's 1/N share, the others' values there wait in their
residuals) the union delivers every rank's value on every selected
coordinate at once, so the average on the support is exact and the ranks'
residuals off it are all that waits. Against ``cyclic`` (one rank's support
per call) no coordinate large on one rank waits for its turn as leader. The
price is bytes: ``k`` indices per rank through an allgather, then up to
``N k`` values through an allreduce (``|union|``; fewer where supports
overlap). With error feedback each rank keeps everything off the union.

The union and the allreduce's sum are identical on every rank, so the
results are bit-identical on every rank. Per rank and call this rank hands
over: one int64 size and one int64 count per tensor (the size exchange of
a variable allgather; counts may differ between ranks with a threshold),
its indices, padded to the largest rank's, to 8 bytes, and the
``|union|`` values of the allreduce. The indices are int32, or int64 when
a tensor of the call has 2^31 elements or more (the built-in sparsifiers
refuse such tensors, :func:`gradpress.compress.sparse.check_indexable`; a
sparsifier of your own may send int64 indices for them). Every rank runs
the compressor on its own tensors, so per-tensor compressor state stays on
every rank (the threshold estimators are accepted). The union of every
tensor is formed at once (one ``unique`` over indices offset by each
tensor's start, one read of the sizes), so a call waits on its device
twice, not once per tensor.
"""

from __future__ import annotations

import time

import torch

from gradpress.compress.base import Compressor, Context
from gradpress.compress.sparse import MAX_INDEXED
from gradpress.exchange.base import ExchangeResult, Prelude, Strategy, register_strategy
from gradpress.exchange.costs import CostModel
from gradpress.exchange.feedback import Feedback
from gradpress.exchange.strategies.support import mean_on_support, sparsifier_refusal
from gradpress.transport.collectives import allgather_with_head


@register_strategy("union")
class Union(Strategy):
    order = 6
    planned = False  # a different estimator, not a faster way to move the same one: the user opts in

    def supports(self, compressor: Compressor) -> str | None:
        return sparsifier_refusal(compressor, "it averages every rank's values on the union of their supports",
                                  "topk, threshold, dgc_threshold, sidco, gaussiank, redsync")

    @classmethod
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool, *,
                elem_size: int = 4) -> tuple[float, int]:
        """``ENC(d) + AG(c(d) / 2) + AR(N c(d) / 2)``: the indices (half of a
        value-index packet) gathered, then at most N supports' values summed
        (disjoint supports: the worst case)."""
        d = float(numel)
        half = costs.wire(d) / 2
        return costs.encode(d) + costs.allgather(half) + costs.allreduce(half * world_size), 1

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
    ) -> ExchangeResult:
        if not tensors:
            return ExchangeResult([], 0, [] if feedback is not None else None, [], 0.0, 0.0)
        t0 = time.perf_counter()
        flats = [t.reshape(-1) for t in tensors]
        device = flats[0].device
        index_dtype = torch.int64 if any(f.numel() > MAX_INDEXED for f in flats) else torch.int32  # same on every rank
        chosen = [compressor.encode(t, c).tensors[1].reshape(-1).to(index_dtype) for t, c in zip(tensors, ctxs)]
        counts = torch.tensor([c.numel() for c in chosen], dtype=torch.int64, device=device)
        t1 = time.perf_counter()
        heads, buffers, sent = allgather_with_head(torch.cat(chosen).view(torch.uint8), counts.view(torch.uint8),
                                                   self.group, self.world_size, variable=True)
        t2 = time.perf_counter()
        support = self._union([h.view(torch.int64) for h in heads], buffers, [f.numel() for f in flats], device,
                              index_dtype)
        results, residuals, value_bytes, nbytes, allreduce_s = mean_on_support(
            tensors, flats, support, self.group, self.world_size, out, feedback is not None)
        sent += nbytes
        tensor_bytes = [v + c.numel() * c.element_size() for v, c in zip(value_bytes, chosen)]
        compress_s = (t1 - t0) + (time.perf_counter() - t2 - allreduce_s)
        return ExchangeResult(results, sent, residuals, tensor_bytes, compress_s, (t2 - t1) + allreduce_s)

    @staticmethod
    def _union(counts: list[torch.Tensor], buffers: list[torch.Tensor], numels: list[int],
               device: torch.device, index_dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
        """Per tensor, the sorted union of every rank's ``buffers`` (bytes of
        ``index_dtype`` indices: rank r's ``counts[r][i]`` indices of tensor i,
        in tensor order): one ``unique`` over the indices offset by each
        tensor's start (int64), split back."""
        starts = torch.tensor([0, *numels], dtype=torch.int64, device=device).cumsum(0)
        width = index_dtype.itemsize
        shifted = [b.view(index_dtype).long() + torch.repeat_interleave(starts[:-1], c, output_size=b.numel() // width)
                   for c, b in zip(counts, buffers)]
        merged = torch.unique(torch.cat(shifted))
        sizes = torch.searchsorted(merged, starts).diff().tolist()
        return [part - start for part, start in zip(merged.split(sizes), starts[:-1])]
