"""``allgather``: the general path for any compressor.

All of a call's packets travel as one byte buffer (see
:mod:`gradpress.transport.wire`).
Variable-size packets first exchange their sizes (one int64 per rank), then
pad to the largest (rounded up to 8 bytes so every slice stays aligned),
allgather and trim: gloo has no allgatherv. Each rank decodes every rank's
packets in rank order and folds them with the compressor's aggregation, so
results are bit-identical across ranks.

Sparse packets with exact values (top-k, threshold and DGC-style methods:
``exact_values``, payload ``[values, indices]``) are averaged without
decoding each rank's packet into a dense tensor: on CPU one
:func:`~gradpress.compress.sparse.sparse_sum` over all ranks' packets in rank
order, which equals the rank-order fold of the dense decodes (it was the
larger part of a top-k step at 10M parameters: N dense fills plus N - 1 dense
additions, see docs/bench.md "Where the time goes").
"""

from __future__ import annotations

import time

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.compress.sparse import sparse_sum
from gradpress.exchange.base import ExchangeResult, Prelude, Strategy, aggregate, encode_local, register_strategy
from gradpress.exchange.costs import CostModel
from gradpress.exchange.feedback import Feedback
from gradpress.transport import wire
from gradpress.transport.collectives import allgather_bytes


@register_strategy("allgather")
class Allgather(Strategy):
    order = 1
    general = True

    @classmethod
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool) -> tuple[float, int]:
        """``ENC(d) + AG(c(d)) + N DEC(d)``."""
        d = float(numel)
        return costs.encode(d) + costs.allgather(costs.wire(d)) + world_size * costs.decode(d), 1

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
    ) -> ExchangeResult:
        t0 = time.perf_counter()
        packets, residuals = encode_local(compressor, tensors, ctxs, 1.0, feedback)
        variable = bool(compressor.variable_size)
        buffer = wire.pack_packets(packets, variable)
        t1 = time.perf_counter()
        buffers, sent = allgather_bytes(buffer, self.group, self.world_size, variable)
        t2 = time.perf_counter()
        by_rank = [packets if r == self.rank else wire.unpack_packets(buf, packets, variable) for r, buf in enumerate(buffers)]
        if _sparse(compressor, packets):
            # written straight into the caller's output where it can (no dense temporary, no copy back)
            results = []
            for i, p in enumerate(packets):
                dst = _flat_out(out, i, p)
                total = sparse_sum([by_rank[r][i].tensors[0] for r in range(len(buffers))],
                                   [by_rank[r][i].tensors[1] for r in range(len(buffers))], p.numel, p.dtype, dst)
                total.div_(self.world_size)
                results.append(out[i] if dst is not None and out is not None else total.view(p.shape))
        else:
            decoded_by_rank = [[compressor.decode(p) for p in theirs] for theirs in by_rank]
            results = [
                aggregate(compressor, [decoded_by_rank[r][i] for r in range(len(buffers))], self.world_size)
                for i in range(len(packets))
            ]
        compress_s = (t1 - t0) + (time.perf_counter() - t2)
        return ExchangeResult(results, sent, residuals, [p.nbytes for p in packets], compress_s, t2 - t1)


def _sparse(compressor: Compressor, packets: list[Packet]) -> bool:
    """Whether every packet is ``[values, integer flat indices]`` of a method
    whose decode scatters the values exactly (``exact_values``), averaged
    by mean, on CPU (where :func:`sparse_sum` accumulates in a fixed order)."""
    if not compressor.exact_values or compressor.aggregation != "mean" or not packets:
        return False
    return all(len(p.tensors) == 2 and p.tensors[1].device.type == "cpu" and not p.tensors[1].is_floating_point()
               and p.tensors[0].is_floating_point() for p in packets)


def _flat_out(out: list[torch.Tensor] | None, i: int, packet: Packet) -> torch.Tensor | None:
    """The caller's i-th output as a flat view, when the sum can be written there."""
    o = out[i] if out is not None and i < len(out) else None
    if o is None or o.dtype != packet.dtype or not o.is_contiguous() or o.numel() != packet.numel:
        return None
    return o.view(-1)
