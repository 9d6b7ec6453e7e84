"""``allgather``: the general path for any compressor.

All of a call's packets travel as one byte buffer (see
:mod:`gradpress.transport.wire`).
Variable-size packets first exchange their sizes (one int64 per rank), then
pad to the largest (rounded up to 8 bytes so every slice stays aligned),
allgather and trim: gloo has no allgatherv. Each rank decodes every rank's
packets in rank order and folds them with the compressor's aggregation, so
results are bit-identical across ranks.
"""

from __future__ import annotations

import time

import torch

from gradpress.compress.base import Compressor, Context
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
        decoded_by_rank = []
        for r, buf in enumerate(buffers):
            theirs = packets if r == self.rank else wire.unpack_packets(buf, packets, variable)
            decoded_by_rank.append([compressor.decode(p) for p in theirs])
        results = [
            aggregate(compressor, [decoded_by_rank[r][i] for r in range(len(buffers))], self.world_size)
            for i in range(len(packets))
        ]
        compress_s = (t1 - t0) + (time.perf_counter() - t2)
        return ExchangeResult(results, sent, residuals, [p.nbytes for p in packets], compress_s, t2 - t1)
