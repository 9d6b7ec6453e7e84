"""Collectives on flat buffers: a fused allreduce of many tensors and an
allgather of byte buffers whose sizes may differ between ranks.

Both return the bytes this rank handed to the collective (payload, padding,
size exchanges), which is what ``stats["bytes_sent"]`` counts. A world of
one (or no process group) moves nothing but still counts what would be
handed over, so figures compare across world sizes. No empty collective is
ever issued.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["fused_allreduce", "flat_by_dtype", "allgather_bytes", "allgather_with_head"]


def flat_by_dtype(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One fused buffer per dtype (dtypes in order of first appearance; a
    dtype's tensors in order, detached copies) and, per tensor, its view into
    its buffer, shaped like it: what one collective per dtype works on."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    flats: list[torch.Tensor] = []
    views: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in groups.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        for i, v in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            views[i] = v.view(tensors[i].shape)
        flats.append(flat)
    return flats, views  # type: ignore[return-value]


def fused_allreduce(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> tuple[list[torch.Tensor], int]:
    """Allreduce-sum ``tensors`` (grouped by dtype, one collective per dtype).
    Returns the summed tensors (same order, same shapes) and the bytes handed over."""
    out = list(tensors)  # empty tensors come back as they are
    full = [i for i, t in enumerate(tensors) if t.numel()]
    flats, views = flat_by_dtype([tensors[i] for i in full])
    sent = 0
    for flat in flats:
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        sent += flat.numel() * flat.element_size()
    for i, v in zip(full, views):
        out[i] = v
    return out, sent


def allgather_bytes(buffer: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, variable: bool) -> tuple[list[torch.Tensor], int]:
    """Gather every rank's uint8 ``buffer`` (sizes may differ when
    ``variable``: one int64 size exchange first, then padding to the largest,
    rounded up to 8 bytes; gloo has no allgatherv). Returns the per-rank
    buffers and the bytes handed over."""
    _, buffers, sent = allgather_with_head(buffer, None, group, world_size, variable)
    return buffers, sent


def allgather_with_head(buffer: torch.Tensor, head: torch.Tensor | None, group: dist.ProcessGroup | None,
                        world_size: int, variable: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """As :func:`allgather_bytes`, with a uint8 ``head`` of the same length on
    every rank travelling in the first collective (with the sizes when
    ``variable``, else in front of the buffer): one collective fewer for a
    caller that has small fixed-size data to share (the engine's prelude).
    Returns (per-rank heads, per-rank buffers, bytes handed over); every
    buffer starts 8-byte aligned."""
    head = head if head is not None else torch.zeros(0, dtype=torch.uint8, device=buffer.device)
    h = head.numel()
    h8 = (h + 7) // 8 * 8
    if world_size == 1 or not dist.is_initialized():
        # nothing travels, but count what would be handed over (size exchange and padding
        # included, as below), as the allreduce paths do
        return [head], [buffer], (h8 + 8 if variable else h8) + (buffer.numel() + 7) // 8 * 8
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    sent = 0
    if variable:
        first = torch.zeros(h8 + 8, dtype=torch.uint8, device=buffer.device)
        first[:h] = head
        first[h8:].view(torch.int64).fill_(buffer.numel())
        got = torch.empty(world_size * first.numel(), dtype=torch.uint8, device=buffer.device)
        gather_single(got, first, group=group)
        sent += first.numel()
        rows = got.view(world_size, -1)
        heads = [rows[r, :h] for r in range(world_size)]
        sizes = [int(s) for s in rows[:, h8:].contiguous().view(torch.int64).reshape(-1).tolist()]
        offset = 0
    else:
        sizes = [buffer.numel()] * world_size
        offset = h8
    width = offset + (max(sizes) + 7) // 8 * 8
    padded = torch.zeros(width, dtype=torch.uint8, device=buffer.device)
    if not variable:
        padded[:h] = head
    padded[offset : offset + buffer.numel()] = buffer
    gathered = torch.empty(world_size * width, dtype=torch.uint8, device=buffer.device)
    if width:  # 0 on every rank alike (the sizes are known to all): no empty collective
        gather_single(gathered, padded, group=group)
    sent += width
    if not variable:
        heads = [gathered[r * width : r * width + h] for r in range(world_size)]
    buffers = [gathered[r * width + offset : r * width + offset + sizes[r]] for r in range(world_size)]
    return heads, buffers, sent
