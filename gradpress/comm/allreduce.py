"""``allreduce``: sum summable packets elementwise, one fused collective per
payload dtype, then decode once. Packets are encoded from x / N, so the
decoded sum is the average (and fp16 sums do not overflow). The summed
packet is decoded with the local packet's metadata, which every rank shares
(shape, dtype, shared-seed facts such as random-k's seed)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradpress.comm.base import ExchangeResult, Strategy, encode_local, register_strategy
from gradpress.compress.base import Compressor, Context, Packet


def fused_allreduce(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> tuple[list[torch.Tensor], int]:
    """Allreduce-sum ``tensors`` (grouped by dtype, one collective per dtype).
    Returns the summed tensors (same order) and the bytes handed over."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(i)
        else:
            out[i] = t
    sent = 0
    for idxs in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idxs])
        if dist.is_initialized():
            dist.all_reduce(flat, group=group)
        sent += flat.numel() * flat.element_size()
        offset = 0
        for i in idxs:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].view_as(tensors[i])
            offset += n
    return out, sent  # type: ignore[return-value]


@register_strategy("allreduce")
class Allreduce(Strategy):

    def supports(self, compressor: Compressor) -> str | None:
        if not compressor.is_summable:
            return f"compressor {compressor.name!r} is not summable; use strategy 'allgather' (or 'auto')"
        return None

    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], want_feedback: bool
    ) -> ExchangeResult:
        t0 = time.perf_counter()
        packets, residuals = encode_local(compressor, tensors, ctxs, 1.0 / self.world_size, want_feedback)
        payloads = [t for p in packets for t in p.tensors]
        t1 = time.perf_counter()
        summed, sent = fused_allreduce(payloads, self.group)
        t2 = time.perf_counter()
        results = []
        pos = 0
        for p in packets:
            n = len(p.tensors)
            # the summed payload keeps the local packet's metadata (shared by all ranks)
            results.append(compressor.decode(Packet(summed[pos : pos + n], p.shape, p.dtype, dict(p.meta))))
            pos += n
        compress_s = (t1 - t0) + (time.perf_counter() - t2)
        return ExchangeResult(results, sent, None, [p.nbytes for p in packets], compress_s, residuals)
