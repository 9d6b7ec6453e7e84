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
from gradpress.exchange.base import Encoded, ExchangeResult, Prelude, Strategy, encode_local, register_strategy
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
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool, *,
                elem_size: int = 4) -> tuple[float, int]:
        """``ENC(d) + AR(c(d)) + DEC(d)``."""
        d = float(numel)
        return costs.encode(d) + costs.allreduce(costs.wire(d)) + costs.decode(d), 1

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
        encoded: Encoded | None = None,
    ) -> ExchangeResult:
        """``encoded``: what :meth:`encode` made of these tensors earlier (its
        residuals are then the caller's: none are returned)."""
        if compressor.rounds > 1:
            return run_rounds(compressor, tensors, ctxs, feedback, self.group, prelude, out)
        t0 = time.perf_counter()
        residuals = None
        if encoded is None:
            encoded = self.encode(compressor, tensors, ctxs, feedback)
            residuals = encoded.residuals
        payloads = list(encoded.buffer)
        extra = prelude.tensors if prelude is not None else []
        t1 = time.perf_counter()
        summed, sent = fused_allreduce([*payloads, *extra], self.group)
        t2 = time.perf_counter()
        if prelude is not None and prelude.on_summed(summed[len(payloads):]):
            return ExchangeResult([], sent, compress_s=t1 - t0, comm_s=t2 - t1, stopped=True)
        results = self.combine(compressor, encoded, summed[: len(payloads)])
        compress_s = (t1 - t0) + (time.perf_counter() - t2)
        return ExchangeResult(results, sent, residuals, [p.nbytes for p in encoded.packets], compress_s, t2 - t1)

    def encode(self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
               feedback: Feedback | None) -> Encoded:
        """Packets of ``t / N`` (one-round compressors only; no collective); the
        ``buffer`` is the list of their payload tensors, in packet order."""
        t0 = time.perf_counter()
        packets, residuals = encode_local(compressor, tensors, ctxs, 1.0 / self.world_size, feedback,
                                          self.world_size)
        payloads = [t for p in packets for t in p.tensors]
        return Encoded(packets, residuals, payloads, time.perf_counter() - t0)

    def move(self, compressor: Compressor, encoded: Encoded) -> tuple[list[torch.Tensor], int]:
        """The collective alone: the summed payloads and the bytes handed over."""
        return fused_allreduce(list(encoded.buffer), self.group)

    def combine(self, compressor: Compressor, encoded: Encoded, summed: list[torch.Tensor],
                out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Decode the summed payloads with the local packets' metadata (shared by all ranks)."""
        results, pos = [], 0
        for p in encoded.packets:
            n = len(p.tensors)
            results.append(compressor.decode(Packet(summed[pos : pos + n], p.shape, p.dtype, dict(p.meta))))
            pos += n
        return results
