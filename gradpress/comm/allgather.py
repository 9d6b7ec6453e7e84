"""``allgather``: the general path for any compressor.

All of a bucket's packets travel as one byte buffer (see ``gradpress.wire``).
Variable-size packets first exchange their sizes (one int64 per rank), then
pad to the largest (rounded up to 8 bytes so every slice stays aligned),
allgather and trim: gloo has no allgatherv. Each rank decodes every rank's
packets in rank order and folds them with the compressor's aggregation, so
results are bit-identical across ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradpress import wire
from gradpress.comm.base import ExchangeResult, Strategy, aggregate, encode_local, register_strategy
from gradpress.compress.base import Compressor, Context


def allgather_bytes(buffer: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, variable: bool) -> tuple[list[torch.Tensor], int]:
    """Gather every rank's uint8 ``buffer`` (sizes may differ when
    ``variable``). Returns the per-rank buffers and the bytes handed over."""
    if world_size == 1 or not dist.is_initialized():
        # nothing travels, but count what would be handed over, as the allreduce paths do
        return [buffer], buffer.numel()
    sent = 0
    if variable:
        size = torch.tensor([buffer.numel()], dtype=torch.int64, device=buffer.device)
        sizes_out = [torch.empty_like(size) for _ in range(world_size)]
        dist.all_gather(sizes_out, size, group=group)
        sent += size.numel() * size.element_size()
        sizes = [int(s) for s in torch.cat(sizes_out).tolist()]
    else:
        sizes = [buffer.numel()] * world_size
    width = (max(sizes) + 7) // 8 * 8
    padded = torch.zeros(width, dtype=torch.uint8, device=buffer.device)
    padded[: buffer.numel()] = buffer
    gathered = torch.empty(world_size * width, dtype=torch.uint8, device=buffer.device)
    _gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _gather_single(gathered, padded, group=group)
    sent += width
    return [gathered[r * width : r * width + sizes[r]] for r in range(world_size)], sent


@register_strategy("allgather")
class Allgather(Strategy):
    def exchange(
        self, compressor: Compressor, tensors: list[torch.Tensor], ctxs: list[Context], want_feedback: bool
    ) -> ExchangeResult:
        t0 = time.perf_counter()
        packets, residuals = encode_local(compressor, tensors, ctxs, 1.0, want_feedback)
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
        return ExchangeResult(results, sent, None, [p.nbytes for p in packets], compress_s, residuals)
