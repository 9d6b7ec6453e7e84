"""``allgather``: the general path for any compressor.

The engine's prelude (the call's uncompressed tensors and NaN/Inf flags)
travels in the first collective when it is small (<= 64 KiB): with the size
exchange for variable-size packets, else in front of the packets; every rank
then sums the ranks' preludes in rank order (bit-identical everywhere). One
collective fewer per call than summing it apart; a larger prelude is
allreduced first, as before.

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
from gradpress.exchange.base import (
    Encoded,
    ExchangeResult,
    Prelude,
    Strategy,
    aggregate_packets,
    encode_local,
    register_strategy,
)
from gradpress.exchange.costs import CostModel
from gradpress.exchange.feedback import Feedback
from gradpress.transport import wire
from gradpress.transport.collectives import allgather_with_head, fused_allreduce

#: largest prelude (bytes) that travels inside the allgather instead of its own allreduce
PRELUDE_INLINE = 1 << 16


@register_strategy("allgather")
class Allgather(Strategy):
    order = 1
    general = True
    carries_prelude = True

    @classmethod
    def predict(cls, costs: CostModel, numel: int, world_size: int, summable: bool, *,
                elem_size: int = 4) -> tuple[float, int]:
        """``ENC(d) + AG(c(d)) + N DEC(d)``."""
        d = float(numel)
        return costs.encode(d) + costs.allgather(costs.wire(d)) + world_size * costs.decode(d), 1

    def encode(self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
               feedback: Feedback | None) -> Encoded:
        """The local half of :meth:`exchange`: encode and pack (no collective),
        so that it can run ahead, in another thread than the exchange."""
        t0 = time.perf_counter()
        packets, residuals = encode_local(compressor, tensors, ctxs, 1.0, feedback)
        buffer = wire.pack_packets(packets, bool(compressor.variable_size))
        return Encoded(packets, residuals, buffer, time.perf_counter() - t0)

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context],
        feedback: Feedback | None, *, prelude: Prelude | None = None, out: list[torch.Tensor] | None = None,
        encoded: Encoded | None = None,
    ) -> ExchangeResult:
        """``encoded``: what :meth:`encode` made of these tensors earlier (its
        residuals are then the caller's: none are returned)."""
        t0 = time.perf_counter()
        sent, comm = 0, 0.0
        head = _prelude_bytes(prelude) if prelude is not None else None
        if prelude is not None and head is None:  # too large to ride along: summed on its own first
            summed, sent = fused_allreduce(prelude.tensors, self.group)
            comm = time.perf_counter() - t0
            if prelude.on_summed(summed):
                return ExchangeResult([], sent, comm_s=comm, stopped=True, plain_bytes=sent)
            t0 = time.perf_counter()
        if encoded is None:
            encoded = self.encode(compressor, tensors, ctxs, feedback)
            residuals = encoded.residuals
        else:
            residuals, t0 = None, time.perf_counter()  # its encoding time was counted where it ran
        variable = bool(compressor.variable_size)
        t1 = time.perf_counter()
        heads, buffers, nbytes = allgather_with_head(encoded.buffer, head, self.group, self.world_size, variable)
        plain, sent = sent, sent + nbytes
        t2 = time.perf_counter()
        comm += t2 - t1
        if head is not None and prelude is not None and prelude.on_summed(_sum_preludes(heads, prelude.tensors)):
            return ExchangeResult([], sent, compress_s=t1 - t0, comm_s=comm, stopped=True)
        results = self.combine(compressor, encoded, buffers, out)
        compress_s = (t1 - t0) + (time.perf_counter() - t2)
        return ExchangeResult(results, sent, residuals, [p.nbytes for p in encoded.packets], compress_s, comm,
                              plain_bytes=plain)

    def move(self, compressor: Compressor, encoded: Encoded) -> tuple[list[torch.Tensor], int]:
        """The collective alone: every rank's packed buffer (in rank order)
        and the bytes handed over; no prelude."""
        _, buffers, nbytes = allgather_with_head(encoded.buffer, None, self.group, self.world_size,
                                                 bool(compressor.variable_size))
        return buffers, nbytes

    def combine(self, compressor: Compressor, encoded: Encoded, buffers: list[torch.Tensor],
                out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The average of every rank's packets (``buffers`` from :meth:`move`,
        this rank's own packets taken from ``encoded``), folded in rank order."""
        packets, variable = encoded.packets, bool(compressor.variable_size)
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
            return results
        # each rank's packet decoded into one scratch buffer and added into the caller's output where it fits
        results, scratch = [], None
        for i, p in enumerate(packets):
            dst = _flat_out(out, i, p)
            if dst is not None and p.aliases(dst):  # this rank's payload is the output itself (none; fp16 of fp16)
                dst = None
            if scratch is None or scratch.numel() < p.numel or scratch.dtype != p.dtype:
                scratch = torch.empty(p.numel, dtype=p.dtype, device=_device(p)) if len(buffers) > 1 else None
            total = aggregate_packets(compressor, [by_rank[r][i] for r in range(len(buffers))], self.world_size, dst,
                                      None if scratch is None else scratch[: p.numel])
            results.append(out[i] if dst is not None and out is not None else total.view(p.shape))
        return results

def _sparse(compressor: Compressor, packets: list[Packet]) -> bool:
    """Whether every packet is ``[values, integer flat indices]`` of a method
    whose decode scatters the values exactly (``exact_values``), averaged
    by mean, on CPU (where :func:`sparse_sum` accumulates in a fixed order)."""
    if not compressor.exact_values or compressor.aggregation != "mean" or not packets:
        return False
    return all(len(p.tensors) == 2 and p.tensors[1].device.type == "cpu" and not p.tensors[1].is_floating_point()
               and p.tensors[0].is_floating_point() for p in packets)


def _device(packet: Packet) -> torch.device | None:
    return packet.tensors[0].device if packet.tensors else None


def _flat_out(out: list[torch.Tensor] | None, i: int, packet: Packet) -> torch.Tensor | None:
    """The caller's i-th output as a flat view, when the sum can be written there."""
    o = out[i] if out is not None and i < len(out) else None
    if o is None or o.dtype != packet.dtype or not o.is_contiguous() or o.numel() != packet.numel:
        return None
    return o.view(-1)


def _prelude_bytes(prelude: Prelude) -> torch.Tensor | None:
    """The prelude's tensors as one uint8 buffer (each padded to 8 bytes), or
    None when it is larger than :data:`PRELUDE_INLINE`."""
    parts = []
    for t in prelude.tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        if raw.numel() % 8:
            parts.append(raw.new_zeros(8 - raw.numel() % 8))
    total = sum(p.numel() for p in parts)
    if total > PRELUDE_INLINE:
        return None
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def _sum_preludes(heads: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's prelude summed in rank order, shaped like ``like``."""
    out = []
    offset = 0
    for t in like:
        n = t.numel() * t.element_size()
        parts = [h[offset : offset + n].view(t.dtype).view(t.shape) for h in heads]
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        out.append(total)
        offset += (n + 7) // 8 * 8
    return out
