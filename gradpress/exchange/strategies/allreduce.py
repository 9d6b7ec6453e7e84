"""``allreduce``: sum summable packets elementwise, one fused collective per
payload dtype, then decode once. Packets are encoded from x / N, so the
decoded sum is the average (and fp16 sums do not overflow). The summed
packet is decoded with the local packet's metadata, which every rank shares
(shape, dtype, shared-seed facts such as random-k's seed).

The engine's prelude (uncompressed tensors, NaN/Inf flags) rides in the same
fused collective. Multi-round compressors (PowerSGD: P then Q) are summable
too; their rounds are driven by :mod:`gradpress.exchange.strategies.rounds` behind the
same contract, the prelude riding in the first round.
"""

from __future__ import annotations

import time

import torch

from gradpress.compress.base import Compressor, Context, Packet
from gradpress.exchange.base import ExchangeResult, Prelude, Strategy, encode_local, register_strategy
from gradpress.exchange.costs import CostModel
from gradpress.exchange.feedback import Feedback
from gradpress.exchange.strategies.rounds import run_rounds
from gradpress.transport.collectives import fused_allreduce


@register_strategy("allreduce")
class Allreduce(Strategy):
    carries_prelude = True
    order = 0
    general = True
    summable_only = True

    def supports(self, compressor: Compressor) -> str | None:
        if not compressor.is_summable:
            return f"compressor {compressor.name!r} is not summable; use strategy 'allgather' (or 'auto')"
        return None

    @classmethod
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool) -> tuple[float, int]:
        """``ENC(d) + AR(c(d)) + DEC(d)``."""
        d = float(numel)
        return costs.encode(d) + costs.allreduce(costs.wire(d)) + costs.decode(d), 1

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
    ) -> ExchangeResult:
        if compressor.rounds > 1:
            return run_rounds(compressor, tensors, ctxs, feedback, self.group, prelude, out)
        t0 = time.perf_counter()
        packets, residuals = encode_local(compressor, tensors, ctxs, 1.0 / self.world_size, feedback)
        payloads = [t for p in packets for t in p.tensors]
        extra = prelude.tensors if prelude is not None else []
        t1 = time.perf_counter()
        summed, sent = fused_allreduce([*payloads, *extra], self.group)
        t2 = time.perf_counter()
        if prelude is not None and prelude.on_summed(summed[len(payloads):]):
            return ExchangeResult([], sent, compress_s=t1 - t0, comm_s=t2 - t1, stopped=True)
        results = []
        pos = 0
        for p in packets:
            n = len(p.tensors)
            # the summed payload keeps the local packet's metadata (shared by all ranks)
            results.append(compressor.decode(Packet(summed[pos : pos + n], p.shape, p.dtype, dict(p.meta))))
            pos += n
        compress_s = (t1 - t0) + (time.perf_counter() - t2)
        return ExchangeResult(results, sent, residuals, [p.nbytes for p in packets], compress_s, t2 - t1)
